"""The OpenAI API surface through the official ``openai`` client, against a real server process
running the real engine on the tiny random Llama (``doublesparse.server.fake_engine:tiny_engine``): n,
best_of, lists of prompts, echo, logprobs, penalties, response_format and tools.

The tiny model's tokens are single bytes, so its text is gibberish; what is checked is the
contract (indices, counts, reproducibility, that grammars hold), not the words. The server is
the real app under uvicorn on 127.0.0.1, run in a thread of the test process: a subprocess would
spend most of this module's time importing torch again.
"""

from __future__ import annotations

import json

import openai
import pytest

from server_utils import KEY, InProcessServer

U = [{"role": "user", "content": "What is the weather?"}]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}}}]


@pytest.fixture(scope="module")
def srv():
    from doublesparse.server.app import create_app
    from doublesparse.server.config import ServerConfig
    from doublesparse.server.fake_engine import tiny_engine

    s = InProcessServer(create_app(tiny_engine(max_total_tokens=16384), ServerConfig(api_key=KEY)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def c(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_n_seeded_streaming_and_prompt_lists(srv, c):
    kw = dict(model="tiny-llama", max_tokens=5, temperature=1.0, seed=11)
    r = c.completions.create(prompt="Once upon", n=3, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert len({ch.text for ch in r.choices}) > 1            # the samples differ ...
    again = c.completions.create(prompt="Once upon", n=3, **kw)
    assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]   # ... reproducibly
    assert r.usage.completion_tokens <= 15
    assert r.usage.prompt_tokens == len("Once upon")         # counted once, not per sample

    texts = {0: "", 1: "", 2: ""}
    for ch in c.completions.create(prompt="Once upon", n=3, stream=True, **kw):
        for x in ch.choices:
            texts[x.index] += x.text
    assert [texts[i] for i in range(3)] == [ch.text for ch in r.choices]

    # a list of prompts: prompt i's sample j is choice i * n + j; greedy equals one at a time
    prompts = ["abc", "hello there", "hi"]
    g = dict(model="tiny-llama", max_tokens=4, temperature=0)
    many = c.completions.create(prompt=prompts, n=2, **g)
    assert [ch.index for ch in many.choices] == list(range(6))
    for i, p in enumerate(prompts):
        one = c.completions.create(prompt=p, **g).choices[0].text
        assert many.choices[2 * i].text == many.choices[2 * i + 1].text == one
    echo = c.completions.create(prompt=[[120, 121], [122]], echo=True, **g)   # token ids
    assert echo.choices[0].text.startswith("xy") and echo.choices[1].text.startswith("z")
    streamed = {0: "", 1: ""}
    for ch in c.completions.create(prompt=[[120, 121], [122]], echo=True, stream=True, **g):
        for x in ch.choices:
            streamed[x.index] += x.text
    assert [streamed[0], streamed[1]] == [ch.text for ch in echo.choices]

    chat = c.chat.completions.create(model="tiny-llama", messages=U, n=2, max_tokens=4, seed=5)
    assert [ch.index for ch in chat.choices] == [0, 1]
    assert all(ch.message.role == "assistant" for ch in chat.choices)


def test_best_of_counts_every_sample(c):
    r = c.completions.create(model="tiny-llama", prompt="abc", max_tokens=3, n=1, best_of=3,
                             temperature=1.0, seed=2, extra_body={"ignore_eos": True})
    assert len(r.choices) == 1 and r.choices[0].index == 0 and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == 9


def test_logprobs_chat_and_completions(c):
    r = c.chat.completions.create(model="tiny-llama", messages=U, max_tokens=6, temperature=0,
                                  logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        # greedy: the sampled token is the most likely one of the model's distribution
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert t.bytes == t.top_logprobs[0].bytes
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs),
                                                             reverse=True)
    streamed = []
    for ch in c.chat.completions.create(model="tiny-llama", messages=U, max_tokens=6,
                                        temperature=0, logprobs=True, top_logprobs=3, stream=True,
                                        extra_body={"ignore_eos": True}):
        if ch.choices and ch.choices[0].logprobs:
            streamed += ch.choices[0].logprobs.content
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content])

    r = c.completions.create(model="tiny-llama", prompt="abc", max_tokens=5, logprobs=2,
                             temperature=0.8, seed=4, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == pytest.approx(v) and 2 <= len(top) <= 3
    assert c.completions.create(model="tiny-llama", prompt="abc", max_tokens=2).choices[0].logprobs \
        is None


def test_penalties_are_honoured(c):
    base = dict(model="tiny-llama", prompt="aaaa", max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
    plain = c.completions.create(**base).choices[0].text
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        assert c.completions.create(**base, **extra).choices[0].text != plain, extra
    rep = c.completions.create(**{**base, "extra_body": {"ignore_eos": True,
                                                         "repetition_penalty": 5.0}})
    assert rep.choices[0].text != plain
    # min_p=1 keeps only the most likely token: sampling at any temperature is then greedy
    mp = c.completions.create(**{**base, "temperature": 1.5, "seed": 9,
                                 "extra_body": {"ignore_eos": True, "min_p": 1.0}})
    assert mp.choices[0].text == plain


@pytest.mark.parametrize("stream", [False, True])
def test_response_format(c, stream):
    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
              "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                               "maximum": 9}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    for seed in (1, 2):
        kw = dict(model="tiny-llama", messages=U, max_tokens=40, temperature=1.0, seed=seed,
                  response_format=fmt)
        if stream:
            text = "".join(ch.choices[0].delta.content or "" for ch in
                           c.chat.completions.create(stream=True, **kw) if ch.choices)
        else:
            text = c.chat.completions.create(**kw).choices[0].message.content
        obj = json.loads(text)
        assert set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool) and 0 <= obj["n"] <= 9
    for max_tokens in (8, 60):  # json_object closes within max_tokens
        r = c.chat.completions.create(model="tiny-llama", messages=U, max_tokens=max_tokens,
                                      temperature=0, response_format={"type": "json_object"})
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_tool_calls(c):
    r = c.chat.completions.create(model="tiny-llama", messages=U, tools=WEATHER, max_tokens=100,
                                  tool_choice="required", temperature=1.0, seed=3)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    # a named function, streamed, n=2: each choice ends with its parsed call
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls = {}
    for chunk in c.chat.completions.create(model="tiny-llama", messages=U, tools=WEATHER, n=2,
                                           max_tokens=100, tool_choice=named, stream=True):
        for x in chunk.choices:
            if x.delta.tool_calls:
                calls[x.index] = (x.delta.tool_calls[0].function.name, x.finish_reason)
    assert calls == {0: ("get_weather", "tool_calls"), 1: ("get_weather", "tool_calls")}
    # the call goes back to the model as an assistant turn plus the tool's answer
    follow = U + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = c.chat.completions.create(model="tiny-llama", messages=follow, tools=WEATHER,
                                  max_tokens=3, tool_choice="none")
    assert r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "n": 129}, "n"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "a", "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": "a", "suffix": "b"}, "suffix"),
    ({"prompt": "a", "min_p": 1.5}, "min_p"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "a", "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"prompt": "a", "response_format": {"type": "xml"}}, "response_format.type"),
    ({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "required": 5}}}},
     "response_format.json_schema.schema"),
    ({"prompt": ["a", ""]}, "prompt.1"),
    ({"messages": U, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": U, "tool_choice": "required"}, "tool_choice"),
    ({"messages": U, "tools": WEATHER, "tool_choice": {"type": "function",
                                                        "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": U, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools.0.function.name"),
    ({"messages": U, "tools": WEATHER * 2}, "tools"),
    ({"messages": U, "tools": WEATHER, "tool_choice": "required", "regex": "a"}, "tool_choice"),
    ({"prompt": "a", "guided_choice": ["a"], "structured_outputs": {"regex": "b"}},
     "structured_outputs.regex"),
])
def test_clear_400s(c, body, param):
    path = "/chat/completions" if "messages" in body else "/completions"
    with pytest.raises(openai.BadRequestError) as e:
        c.post(path, body={"model": "tiny-llama", "max_tokens": 2, **body}, cast_to=object)
    assert e.value.body["param"] == param, e.value.body


def test_nothing_left_behind(srv):
    srv.wait_idle()


def test_tools_need_a_template_that_renders_them():
    from doublesparse.server import protocol as P
    from doublesparse.server.tools import active_tools, parse_tool_calls

    req = P.parse(P.ChatCompletionRequest, json.dumps({"messages": U, "tools": WEATHER}).encode())
    plain = type("Tok", (), {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
    with pytest.raises(P.APIError) as e:
        active_tools(req, plain())
    assert e.value.param == "tools" and "chat template" in e.value.message
    none = P.parse(P.ChatCompletionRequest, json.dumps(
        {"messages": U, "tools": WEATHER, "tool_choice": "none"}).encode())
    assert active_tools(none, plain()) is None     # nothing to render: no template needed

    text = 'ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> <tool_call>{bad}' \
           '</tool_call><tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert content == "ok  <tool_call>{bad}</tool_call>"
    assert parse_tool_calls("no calls") == ("no calls", [])
