"""Tool calling in the Qwen2.5 format (server/tools.py), on a fake engine whose tokenizer carries
Qwen2.5-Coder-1.5B-Instruct's own chat template (copied from the GGUF that ``doublesparse fetch
qwen2.5-coder-1.5b`` downloads) and whose "model" writes a scripted reply: what the server renders
for the model, and what it makes of the model's answers under ``tool_choice="auto"``."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from doublesparse.server.fake_engine import EOS_ID, FakeEngine, FakeTokenizer
from doublesparse.server.tools import parse_tool_calls, repair_chat_template
from server_utils import AUTH, KEY, InProcessServer

QWEN_CODER_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}]
Q = {"role": "user", "content": "What is the weather in Paris?"}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def render(template: str, messages, tools=None, add_generation_prompt=True) -> str:
    """What transformers' apply_chat_template renders (same Jinja settings and tojson)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    return env.from_string(template).render(messages=messages, tools=tools,
                                            add_generation_prompt=add_generation_prompt)


class QwenTemplateTokenizer(FakeTokenizer):
    chat_template = QWEN_CODER_TEMPLATE

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True,
                            tools=None, **_):
        text = render(self.chat_template, messages, tools, add_generation_prompt)
        return self.encode(text) if tokenize else text


class ScriptedEngine(FakeEngine):
    """Answers every request with ``self.reply`` (then EOS) and keeps the prompts it got."""

    def __init__(self, **kw):
        super().__init__(step_delay=0.0, max_context_len=4096, max_total_tokens=65536, **kw)
        self.tokenizer = QwenTemplateTokenizer()
        self.model_config.name = "qwen-fake"
        self.reply, self.prompts = "", []

    def add_request(self, prompt, sampling_params, request_id=None, group=None):
        self.prompts.append(self.tokenizer.decode(prompt))
        return super().add_request(prompt, sampling_params, request_id, group)

    def _next_token(self, r):
        k = len(r.out_ids)
        return ord(self.reply[k]) + 3 if k < len(self.reply) else EOS_ID


@pytest.fixture(scope="module")
def srv():
    from doublesparse.server.app import create_app
    from doublesparse.server.config import ServerConfig

    engine = ScriptedEngine()
    s = InProcessServer(create_app(engine, ServerConfig(api_key=KEY)))
    s.engine = engine
    yield s
    s.stop()


@pytest.fixture(scope="module")
def c(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def test_the_doubled_braces_of_the_example_are_repaired():
    shown = render(QWEN_CODER_TEMPLATE, [Q], WEATHER)
    assert '{{"name": <function-name>' in shown          # the template as published
    tok = QwenTemplateTokenizer()
    assert repair_chat_template(tok) and not repair_chat_template(tok)
    shown = render(tok.chat_template, [Q], WEATHER)
    assert ('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            '</tool_call><|im_end|>') in shown and "{{" not in shown
    assert render(tok.chat_template, [Q]) == render(QWEN_CODER_TEMPLATE, [Q])  # no tools: same
    plain = type("Tok", (), {"chat_template": "{{ messages[0].content }}"})()
    assert not repair_chat_template(plain) and plain.chat_template == "{{ messages[0].content }}"


@pytest.mark.parametrize("reply", [
    f"<tool_call>\n{CALL}\n</tool_call>",               # the template's format
    f"<tool_call>\n{{{CALL}}}\n</tool_call>",           # with the braces of the unrepaired example
    f"<tool_call>\n{CALL}",                             # EOS before the closing tag
    CALL,                                               # bare, as Qwen2.5-Coder-1.5B writes it
    f"```json\n{json.dumps(json.loads(CALL), indent=2)}\n```",   # fenced
    f"{{{CALL}}}",
])
@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_models_calls(srv, c, reply, stream):
    srv.engine.reply = reply
    kw = dict(model="qwen-fake", messages=[Q], tools=WEATHER, tool_choice="auto", max_tokens=200)
    if stream:
        calls, finish, content = [], None, ""
        for chunk in c.chat.completions.create(stream=True, **kw):
            for x in chunk.choices:
                calls += x.delta.tool_calls or []
                content += x.delta.content or ""
                finish = x.finish_reason or finish
    else:
        msg = (r := c.chat.completions.create(**kw)).choices[0].message
        calls, finish, content = msg.tool_calls, r.choices[0].finish_reason, msg.content or ""
    assert finish == "tool_calls" and content == ""
    (call,) = calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # the prompt the model saw shows the format with single braces
    assert '\n{"name": <function-name>, "arguments": <args-json-object>}\n' in srv.engine.prompts[-1]


@pytest.mark.parametrize("reply", [
    '{"name": "get_time", "arguments": {}}',            # not one of the request's tools
    f"Call it like this: {CALL}",                       # text around the object
    '{"name": "get_weather", "city": "Paris"}',         # no arguments object
    '```json\n{"city": "Paris"}\n```',
    "It is sunny in Paris.",
])
def test_auto_leaves_other_answers_as_content(srv, c, reply):
    srv.engine.reply = reply
    r = c.chat.completions.create(model="qwen-fake", messages=[Q], tools=WEATHER, max_tokens=200)
    assert r.choices[0].message.content == reply and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_the_round_trip_renders_as_the_template_expects(srv, c):
    srv.engine.reply = "It is sunny in Paris, 24 C."
    follow = [Q, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    r = c.chat.completions.create(model="qwen-fake", messages=follow, tools=WEATHER)
    assert r.choices[0].message.content == "It is sunny in Paris, 24 C."
    prompt = srv.engine.prompts[-1]
    assert prompt.endswith(
        "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n" + CALL + "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny, 24 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert "{{" not in prompt


def test_a_tool_message_must_name_its_call(srv):
    body = {"messages": [Q, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny"}], "tools": WEATHER}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.2.tool_call_id"


def test_parse_tool_calls_without_names_reads_only_tagged_blocks():
    assert parse_tool_calls(CALL) == (CALL, [])
    assert parse_tool_calls(CALL, names={"get_weather"})[0] is None
    two = CALL + "\n" + CALL.replace("Paris", "Rome")
    assert len(parse_tool_calls(two, names={"get_weather"})[1]) == 2
    assert len(parse_tool_calls(two, parallel=False, names={"get_weather"})[1]) == 1
    listed = f"[{CALL}, {CALL}]"
    assert len(parse_tool_calls(listed, names={"get_weather"})[1]) == 2
