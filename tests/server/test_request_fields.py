"""Request fields beyond the core sampling ones, end to end: the field policy (served, refused
with a 400 naming the field, or ignored with an ``X-Ignored-Fields`` header and a log line) on
the fake engine, and logit_bias, min_tokens and the structured outputs (SGLang's and vLLM's
names, response_format json_object) honoured by the real engine with the embedded SmolLM2."""

from __future__ import annotations

import json
import logging
import re

import httpx
import openai
import pytest

from server_utils import AUTH, KEY, REAL_KW, InProcessServer, fake_in_process

pytestmark = pytest.mark.usefixtures("one_thread")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def fake():
    s = fake_in_process()
    yield s
    s.stop()


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=AUTH, timeout=120)


# ------------------------------------------------------------------------- the field policy
def test_unknown_fields_are_ignored_with_a_header_and_a_log_line(fake, caplog):
    caplog.set_level(logging.WARNING, logger="doublesparse.server")
    r = _post(fake, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi", "refusal": None}], "max_tokens": 2,
        "user": "u-1", "metadata": {"a": "b"}, "bad\r\nname": 1,
        "stream_options": {"include_usage": True}, "stream": True})
    assert r.status_code == 200
    assert r.headers["X-Ignored-Fields"] == 'user, metadata, "bad\\r\\nname", messages.0.refusal'
    assert any("ignored fields" in m and "user" in m for m in caplog.messages)
    r = _post(fake, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2,
                                                                   "stream_interval": 4}})
    assert r.status_code == 200
    assert r.headers["X-Ignored-Fields"] == "sampling_params.stream_interval"
    r = _post(fake, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and "X-Ignored-Fields" not in r.headers
    # a refused request still says what it ignored
    r = _post(fake, "/v1/completions", {"prompt": "x", "max_tokens": 2, "suffix": "y", "user": "u"})
    assert r.status_code == 400 and r.headers["X-Ignored-Fields"] == "user"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("/v1/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("/v1/completions", {"priority": 3}, "priority"),
    ("/v1/completions", {"stop_regex": "x+"}, "stop_regex"),
    ("/v1/completions", {"stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": False}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"add_generation_prompt": False}, "add_generation_prompt"),
    ("/v1/chat/completions", {"structured_outputs": {"json": {}, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ("/generate", {"return_logprob": True}, "return_logprob"),
    ("/generate", {"sampling_params": {"no_stop_trim": True}}, "sampling_params.no_stop_trim"),
    # served fields' own checks
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 100.5}}, "logit_bias.5"),
    ("/v1/completions", {"logit_bias": {str(0x110003): 1}}, "logit_bias"),
    ("/v1/completions", {"min_tokens": 9}, "min_tokens"),
    ("/generate", {"sampling_params": {"min_new_tokens": 9}}, "sampling_params.min_new_tokens"),
    ("/v1/completions", {"regex": "(a"}, "regex"),
    ("/v1/completions", {"ebnf": "root ::= "}, "ebnf"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"json_schema": "[1]"}, "json_schema"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"},
     "guided_regex"),
    ("/v1/chat/completions", {"structured_outputs": {"json_object": True, "regex": "a"}},
     "structured_outputs.json_object"),
    ("/generate", {"sampling_params": {"regex": "(b"}}, "sampling_params.regex"),
])
def test_refused_with_a_400_naming_the_field(fake, path, body, param):
    base = {"prompt": "x", "max_tokens": 8} if path == "/v1/completions" else \
        {"messages": CHAT, "max_tokens": 8} if path.startswith("/v1/chat") else \
        {"text": "x", "sampling_params": {"max_new_tokens": 8}}
    if "sampling_params" in body:
        body = {**body, "sampling_params": {**base["sampling_params"], **body["sampling_params"]}}
    r = _post(fake, path, {**base, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert "/project/" not in err["message"] and ".cc:" not in err["message"]


def test_default_values_of_unserved_fields_are_accepted(fake):
    r = _post(fake, "/v1/completions", {
        "prompt": "x", "max_tokens": 2, "use_beam_search": False, "length_penalty": 1,
        "include_stop_str_in_output": False, "spaces_between_special_tokens": True,
        "priority": 0, "cache_salt": None, "bad_words": [], "modalities": ["text"]})
    assert r.status_code == 200 and "X-Ignored-Fields" not in r.headers


# --------------------------------------------------------------- served: the real engine
@pytest.fixture(scope="module")
def real():
    from doublesparse.server.app import create_app
    from doublesparse.server.config import ServerConfig
    from server_utils import RealEngine

    s = InProcessServer(create_app(RealEngine(**REAL_KW, progress=False),
                                   ServerConfig(api_key=KEY)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model(real):
    return real.app.state.server.model_name


@pytest.fixture(scope="module")
def c(real):
    return openai.OpenAI(base_url=real.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _ids(c, real, text: str) -> list[int]:
    return real.app.state.server.tokenizer.encode(text, add_special_tokens=False)


def test_logit_bias(c, real, model):
    base = dict(model=model, prompt="The capital of France is", max_tokens=3, temperature=0)
    assert c.completions.create(**base).choices[0].text.startswith(" Paris")
    (paris,) = _ids(c, real, " Paris")
    banned = c.completions.create(**base, logit_bias={str(paris): -100}).choices[0].text
    assert not banned.startswith(" Paris"), banned
    (rome,) = _ids(c, real, " Rome")
    forced = c.chat.completions.create(model=model, messages=CHAT, max_tokens=2, temperature=0,
                                       logit_bias={str(rome): 100})
    assert forced.choices[0].message.content == " Rome Rome"
    r = _post(real, "/generate", {"text": "The capital of France is", "sampling_params": {
        "max_new_tokens": 2, "temperature": 0, "logit_bias": {str(paris): -100}}})
    assert not r.json()["text"].startswith(" Paris")


def test_min_tokens_prevents_an_early_end(c, model):
    kw = dict(model=model, messages=CHAT, max_tokens=40, temperature=0)
    short = c.chat.completions.create(**kw)   # "The capital of France is Paris." and EOS
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 10
    held = c.chat.completions.create(**kw, extra_body={"min_tokens": 20})
    assert held.usage.completion_tokens >= 20


def test_structured_outputs(c, real, model):
    kw = dict(model=model, messages=CHAT, max_tokens=30, temperature=1.0, seed=4)
    for extra in ({"guided_choice": ["Paris", "Lyon", "Nice"]},
                  {"structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}}):
        r = c.chat.completions.create(**kw, extra_body=extra)
        assert r.choices[0].message.content in ("Paris", "Lyon", "Nice")
    for extra in ({"regex": r"[A-Z][a-z]+, [0-9]{4}"}, {"guided_regex": r"[A-Z][a-z]+, [0-9]{4}"}):
        text = c.chat.completions.create(**kw, extra_body=extra).choices[0].message.content
        assert re.fullmatch(r"[A-Z][a-z]+, [0-9]{4}", text), text
    schema = {"type": "object", "required": ["city", "year"], "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 20},
                             "year": {"type": "integer", "minimum": 0, "maximum": 3000}}}
    for extra in ({"guided_json": schema}, {"json_schema": json.dumps(schema)},
                  {"structured_outputs": {"json": schema}}):
        r = c.chat.completions.create(**{**kw, "max_tokens": 60}, extra_body=extra)
        obj = json.loads(r.choices[0].message.content)
        assert set(obj) == {"city", "year"} and 0 <= obj["year"] <= 3000
    r = c.completions.create(model=model, prompt="Answer:", max_tokens=10, temperature=0,
                             extra_body={"ebnf": 'root ::= "yes" | "no"'})
    assert r.choices[0].text in ("yes", "no")
    r = _post(real, "/generate", {"text": "Answer:", "sampling_params": {
        "max_new_tokens": 10, "temperature": 0, "regex": "(yes|no)!"}})
    assert r.json()["text"] in ("yes!", "no!")


JSON_PROMPTS = ["Describe the history of Rome in JSON.",
                "Reply in JSON: what is your favourite poem? Quote it in full."]


@pytest.mark.parametrize("max_tokens", [12, 96, 300])
def test_json_object_always_closes(c, model, max_tokens):
    """Prompts and seeds on which a plain JSON-object grammar (the one json_object used before)
    ran to max_tokens=96 inside a string or a number in 3 of the 4 samples: every choice ends
    with stop and parses, at 12 tokens too."""
    for prompt in JSON_PROMPTS:
        r = c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], n=2, seed=1,
            max_tokens=max_tokens, temperature=0.7, response_format={"type": "json_object"})
        for ch in r.choices:
            assert ch.finish_reason == "stop", ch.message.content
            assert isinstance(json.loads(ch.message.content), dict), ch.message.content
        assert r.usage.completion_tokens <= 2 * max_tokens


def test_nothing_left_behind(real, fake):
    real.wait_idle()
    fake.wait_idle()
