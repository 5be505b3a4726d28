"""``/v1/completions`` with ``echo``, ``logprobs`` and ``max_tokens=0``: OpenAI's legacy logprobs
object over prompt and completion, as lm-evaluation-harness's ``local-completions`` model reads it
(its ``parse_logprobs`` is mirrored below), on the real engine with the tiny random Llama; the
prompt's numbers against a full forward of the same model. The fake engine has no prompt
logprobs: it refuses with a 400 that names the field."""

from __future__ import annotations

import json

import httpx
import pytest

from model_utils import full_logprobs
from server_utils import AUTH, KEY, InProcessServer, fake_in_process


@pytest.fixture(scope="module")
def srv():
    from doublesparse.server.app import create_app
    from doublesparse.server.config import ServerConfig
    from doublesparse.server.fake_engine import tiny_engine

    engine = tiny_engine(max_total_tokens=16384, chunked_prefill_size=16)
    s = InProcessServer(create_app(engine, ServerConfig(api_key=KEY)))
    s.engine = engine
    yield s
    s.stop()


def post(srv, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(srv.url + path, json={"model": "tiny-llama", **body}, headers=AUTH, timeout=60)


def parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm_eval.models.openai_completions.LocalCompletionsAPI.parse_logprobs (lm-eval 0.4.13)."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(lps), all(t == max(top.values()) for t, top in zip(lps, tops))))
    return res


def test_echo_logprobs_shape_and_values(srv):
    prompt = "The quick brown fox jumps over the lazy dog, again and again."
    r = post(srv, {"prompt": prompt, "echo": True, "logprobs": 3, "max_tokens": 4, "temperature": 0,
                   "ignore_eos": True})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    lp = ch["logprobs"]
    n = len(prompt.encode())  # byte tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) \
        == len(lp["text_offset"]) == n + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"][:n]) == prompt and ch["text"].startswith(prompt)
    assert lp["text_offset"][:n] == list(range(n)) and lp["text_offset"][n] == len(prompt)
    assert all(3 <= len(t) <= 4 for t in lp["top_logprobs"][1:])
    assert all(t[tok] == v for tok, v, t in zip(lp["tokens"][1:], lp["token_logprobs"][1:],
                                                lp["top_logprobs"][1:]))
    assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["usage"]["prompt_tokens"] == n
    ref = full_logprobs(srv.engine.parts.model, list(prompt.encode()))
    for p in range(1, n):
        assert lp["token_logprobs"][p] == pytest.approx(float(ref[p - 1, prompt.encode()[p]]), abs=2e-4)


def test_lm_eval_loglikelihood_request(srv):
    """The request lm-eval sends for loglikelihood / multiple choice (token ids, a batch of
    them, max_tokens 1, logprobs 1, echo) and what it reads back."""
    ctx, conts = list(b"Question: 2 + 2 = ?\nAnswer:"), [list(b" 4"), list(b" five")]
    body = {"prompt": [ctx + c for c in conts], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    out = post(srv, body).json()
    got = parse_logprobs(out, [len(ctx)] * 2)
    ref = [full_logprobs(srv.engine.parts.model, ctx + c) for c in conts]
    for (ll, greedy), c, lps in zip(got, conts, ref):
        want = sum(float(lps[len(ctx) - 1 + j, t]) for j, t in enumerate(c))
        assert ll == pytest.approx(want, abs=1e-3)
        assert greedy == all(int(lps[len(ctx) - 1 + j].argmax()) == t for j, t in enumerate(c))


def test_max_tokens_zero_returns_the_prompt(srv):
    r = post(srv, {"prompt": "hello world", "echo": True, "max_tokens": 0, "logprobs": 0})
    assert r.status_code == 200, r.text
    d = r.json()
    ch = d["choices"][0]
    assert ch["text"] == "hello world" and ch["finish_reason"] == "length"
    assert len(ch["logprobs"]["tokens"]) == 11 and ch["logprobs"]["token_logprobs"][0] is None
    assert all(len(t) == 1 for t in ch["logprobs"]["top_logprobs"][1:])  # k=0: the token itself
    assert d["usage"] == {"prompt_tokens": 11, "completion_tokens": 0, "total_tokens": 11}
    plain = post(srv, {"prompt": [[104, 105], [106]], "echo": True, "max_tokens": 0}).json()
    assert [c["text"] for c in plain["choices"]] == ["hi", "j"]
    assert all(c["logprobs"] is None for c in plain["choices"])
    bad = post(srv, {"prompt": "hello", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert "echo" in bad.json()["error"]["message"]
    chat = post(srv, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
                "/v1/chat/completions")
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_tokens"


def test_echo_without_logprobs(srv):
    r = post(srv, {"prompt": "abc", "echo": True, "max_tokens": 3, "temperature": 0}).json()
    assert r["choices"][0]["text"].startswith("abc") and r["choices"][0]["logprobs"] is None


def _stream(srv, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", srv.url + "/v1/completions", json={"model": "tiny-llama", **body,
                      "stream": True}, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_streaming_echo_with_logprobs(srv, max_tokens):
    body = {"prompt": ["Once upon a time", "xyz"], "echo": True, "logprobs": 2,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    whole = post(srv, body).json()["choices"]
    text, lps = {0: "", 1: ""}, {0: [], 1: []}
    for ch in _stream(srv, body):
        for c in ch["choices"]:
            text[c["index"]] += c["text"]
            if c["logprobs"]:
                lps[c["index"]].append(c["logprobs"])
    for i in (0, 1):
        assert text[i] == whole[i]["text"]
        merged = {k: sum((x[k] for x in lps[i]), []) for k in whole[i]["logprobs"]}
        assert merged == whole[i]["logprobs"]


def test_engine_without_prompt_logprobs_refuses():
    s = fake_in_process()
    try:
        for body, param in (({"prompt": "ab", "echo": True, "logprobs": 1}, "echo"),
                            ({"prompt": "ab", "echo": True, "max_tokens": 0}, "max_tokens")):
            r = httpx.post(s.url + "/v1/completions", json=body, headers=AUTH, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert r.json()["error"]["code"] == "unsupported"
        ok = httpx.post(s.url + "/v1/completions", json={"prompt": "ab", "echo": True, "max_tokens": 2},
                        headers=AUTH, timeout=30)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"].startswith("ab")
    finally:
        s.stop()


def test_nothing_left_behind(srv):
    srv.wait_idle()
