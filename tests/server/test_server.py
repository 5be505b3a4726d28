"""End-to-end tests of the HTTP server: a real server process on 127.0.0.1 per backend (the
fake-only tests of the app's queueing, naming and failure handling serve it in this process).

Two backends run the same checks:
  * "fake": ``doublesparse.server.fake_engine.FakeEngine`` (milliseconds per step), proving the
    server logic (batching, queueing under a full KV pool, aborts, SIGTERM drain) quickly;
  * "real": the engine with the embedded SmolLM2-135M on CPU.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from server_utils import (AUTH, FAKE_KW, KEY, REAL_KW, RealEngine, Server,  # noqa: F401
                          backend_args, fake_in_process)


@pytest.fixture(scope="module", params=["fake", "real"])
def srv(request):
    s = Server(backend_args(request.param))
    s.kind = request.param
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference_engine(srv):
    """In-process engine of the same kind, for offline greedy references."""
    if srv.kind == "fake":
        from doublesparse.server.fake_engine import FakeEngine
        return FakeEngine(**FAKE_KW)
    return RealEngine(**REAL_KW, enable_double_sparsity=True, progress=False)  # as the server


def offline_greedy(engine, prompts: list[str], max_new: int) -> list[str]:
    """Engine.generate in-process at temperature 0 (all prompts in one offline batch)."""
    sp = {"max_new_tokens": max_new, "temperature": 0.0}
    if hasattr(engine, "sampling_params_cls"):  # the fake: one request at a time
        return [engine.generate(p, sp) for p in prompts]
    return [r["text"] for r in engine.generate(prompts, sp)]


def client(srv, key=KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def model_name(srv) -> str:
    return client(srv).models.list().data[0].id


# ------------------------------------------------------------------------------ happy paths
def test_openai_client_both_endpoints(srv):
    c, m, k = client(srv), model_name(srv), 6 if srv.kind == "fake" else 3
    r = c.completions.create(model=m, prompt="Once upon a time", max_tokens=k, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 6
    assert r.usage.prompt_tokens > 0 and r.choices[0].text
    chunks = list(c.completions.create(model=m, prompt="Once upon a time", max_tokens=k,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens

    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    r = c.chat.completions.create(model=m, messages=msgs, max_tokens=k, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 6
    chunks = list(c.chat.completions.create(model=m, messages=msgs, max_tokens=k, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_no_partial_utf8_characters(srv):
    """max_tokens cutting a multi-byte character never leaves U+FFFD in a response; streamed and
    whole responses agree (SmolLM2's byte-level BPE splits emoji and CJK over several tokens)."""
    if srv.kind == "fake":
        pytest.skip("the fake engine has no detokenizer")
    c, m = client(srv), model_name(srv)
    emoji = [{"role": "user", "content": "Reply with only sun emojis."}]
    for n in (2, 4):  # greedy, both cut an emoji (the third token completes the first one)
        r = c.chat.completions.create(model=m, messages=emoji, max_tokens=n, temperature=0)
        chunks = c.chat.completions.create(model=m, messages=emoji, max_tokens=n, temperature=0, stream=True)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert "\ufffd" not in r.choices[0].message.content and streamed == r.choices[0].message.content
    for n in (2, 3):
        r = c.completions.create(model=m, prompt="日本の首都は", max_tokens=n, temperature=0)
        chunks = c.completions.create(model=m, prompt="日本の首都は", max_tokens=n, temperature=0, stream=True)
        streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert "\ufffd" not in r.choices[0].text and streamed == r.choices[0].text


def test_native_generate(srv):
    body = {"text": "The king", "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    r = httpx.post(srv.url + "/generate", json=body, headers=AUTH, timeout=120).json()
    assert r["meta_info"]["completion_tokens"] <= 5 and r["meta_info"]["finish_reason"]["type"]
    with httpx.stream("POST", srv.url + "/generate", json={**body, "stream": True}, headers=AUTH,
                      timeout=120) as resp:
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["text"] == r["text"]


# How far apart two tokens' offline logprobs may be where the real engine's greedy tokens part
# from the offline ones. A decode row's result does not depend on its batch (models/packed.py),
# but a prompt's K/V do, slightly: the float32 prefill GEMM rounds differently for another row
# count, and a prefix-cache hit computes the prompt in other pieces; the decode's bf16 activations
# carry that on, so two tokens that nearly tie may swap.
NEAR_TIE = 0.2


def test_32_concurrent_clients_match_offline_greedy(srv, reference_engine):
    """Each concurrent client gets the offline greedy tokens of its own prompt (no mix-ups
    between requests). The real engine's tokens may part from the offline ones only at a near-tie
    of the offline logprobs (both tokens within NEAR_TIE nats, the server's among the offline top
    3); the fake's must be equal."""
    prompts = [f"Request number {i}: tell me about {w}" for i, w in
               enumerate(["kings", "ships", "storms", "wine"] * 8)]
    real = srv.kind == "real"
    n = 4 if real else 8

    async def one(ac, p, i):
        body = {"prompt": p, "max_tokens": n, "temperature": 0, "stream": i % 2 == 0,
                **({"logprobs": 3} if real else {})}
        if not body["stream"]:
            r = await ac.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            return ch["text"], ch["logprobs"]["tokens"] if real else None
        text, toks = "", []
        async with ac.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for ln in r.aiter_lines():
                if ln.startswith("data: ") and ln != "data: [DONE]":
                    ch = json.loads(ln[6:])["choices"][0]
                    text += ch["text"]
                    toks += (ch.get("logprobs") or {}).get("tokens", [])
        return text, toks

    async def all_():
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=300) as ac:
            return await asyncio.gather(*(one(ac, p, i) for i, p in enumerate(prompts)))

    got = asyncio.run(all_())
    if not real:
        for p, (g, _), r in zip(prompts, got, offline_greedy(reference_engine, prompts, n)):
            assert g == r, p
        return
    from doublesparse.server.logprobs import TokenText
    tt = TokenText(reference_engine.tokenizer)
    ref = reference_engine.generate(prompts, {"max_new_tokens": n, "temperature": 0.0, "logprobs": 3})
    parted = 0
    for p, (text, toks), r in zip(prompts, got, ref):
        want = [tt.text(i) for i in r["token_ids"]]
        if toks == want:
            assert text == r["text"], p
            continue
        t = next(t for t, (a, b) in enumerate(zip(toks, want)) if a != b)
        lp, top = r["logprobs"][t]
        alt = {tt.text(i): v for i, v in top}
        assert toks[t] in alt and lp - alt[toks[t]] <= NEAR_TIE, (p, t, toks, want, r["logprobs"][t])
        parted += 1
    assert parted <= 8, f"{parted} of 32 requests parted from the offline tokens"
    srv.wait_idle()


# ------------------------------------------------------------------------------ bad input
def _bad_cases(m: str, ctx: int) -> list[tuple[str, object, int, str | None]]:
    u = [{"role": "user", "content": "hi"}]
    C, H = "/v1/completions", "/v1/chat/completions"
    return [
        (C, b"{not json", 400, None),
        (C, b"[1, 2]", 400, None),
        (C, {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
        (C, {"prompt": "hi " * (ctx + 10), "max_tokens": 1}, 400, "prompt"),
        (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        (C, {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
        (C, {"prompt": "hi", "max_tokens": 10 ** 9}, 400, "max_tokens"),
        (C, {"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
        (C, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        (C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
        (C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
        (C, {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
        (C, {"prompt": 123}, 400, "prompt"),
        (C, {"prompt": ""}, 400, "prompt"),
        (C, {"prompt": "hi", "n": 0}, 400, "n"),
        (C, {}, 400, "prompt"),
        (H, {"model": m, "messages": []}, 400, "messages"),
        (H, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        (H, {"messages": "hello"}, 400, "messages"),
        (H, {"messages": u, "stream": "yes"}, 400, "stream"),
        (H, {"messages": u, "n": 1000}, 400, "n"),
        (H, {"messages": u, "max_tokens": 0}, 400, "max_tokens"),
        (H, {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
        (H, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
        (H, {"messages": u, "model": m, "temperature": "hot"}, 400, "temperature"),
        (H, b'{"messages": [' + b'{"role": "user", "content": "' + b"x" * (9 << 20) + b'"}]}',
         413, None),
        ("/generate", {"sampling_params": {"max_new_tokens": 2}}, 400, "text"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 0}}, 400, None),
        # values the sampler cannot represent (int64 top_k, float32 top_p, NaN), each sent
        # several times: none may fail the running stream or count towards stopping the engine
        *[(C, {"prompt": "Hello there, my friend.", "max_tokens": 8, "temperature": 0.8,
               "top_k": 1180591620717411303424}, 400, "top_k")] * 6,
        *[(C, {"prompt": "hi", "max_tokens": 8, "temperature": 0.8, "top_p": 1e-300}, 400,
           "top_p")] * 3,
        (C, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
        (C, {"prompt": "hi", "seed": 2 ** 70}, 400, "seed"),
        (H, b'{"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 1e400}', 400,
         "frequency_penalty"),
        ("/generate", {"text": "hi", "sampling_params": {"top_k": 2 ** 64}}, 400,
         "sampling_params.top_k"),
    ]


def test_bad_inputs_while_long_generation_continues(srv):
    m, ctx = model_name(srv), client(srv).models.list().data[0].model_extra["max_model_len"]
    long_n = 400 if srv.kind == "fake" else 24
    body = {"prompt": "A long story:", "max_tokens": long_n, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def long_run():
        pieces = 0
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=600) as ac:
            async with ac.stream("POST", "/v1/completions", json=body) as r:
                async for ln in r.aiter_lines():
                    if ln.startswith("data: {"):
                        ch = json.loads(ln[6:])
                        pieces += 1
                        last = ch["choices"][0]["finish_reason"]
        return pieces, last

    async def bad_ones():
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=60) as ac:
            for path, payload, status, param in _bad_cases(m, ctx):
                kw = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
                r = await ac.post(path, **kw)
                assert r.status_code == status, (path, str(payload)[:80], r.text[:200])
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]
                if param is not None:
                    assert err["param"] == param, (payload, err)
            return srv.health()

    async def both():
        return await asyncio.gather(long_run(), bad_ones())

    rejected = srv.metric("doublesparse_rejected_requests_total")
    (pieces, finish), health = asyncio.run(both())
    assert srv.metric("doublesparse_rejected_requests_total") - rejected == len(_bad_cases(m, ctx))
    assert finish == "length" and pieces >= long_n // 4  # the long request was not disturbed
    assert health["status"] == "ok"
    srv.wait_idle()


def test_api_key(srv):
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(srv, key="wrong").completions.create(model=model_name(srv), prompt="hi", max_tokens=1)
    assert httpx.get(srv.url + "/v1/models").status_code == 401
    assert httpx.get(srv.url + "/health").status_code == 200


def test_disconnect_frees_kv(srv):
    srv.wait_idle()
    body = {"prompt": "Keep going:", "max_tokens": 900 if srv.kind == "fake" else 400,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True},
                      headers=AUTH, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break  # leave mid-stream: the context manager closes the connection
    with pytest.raises(httpx.ReadTimeout):  # non-streaming client giving up
        httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH, timeout=1.0)
    h = srv.wait_idle(timeout=30)
    assert h["kv_used_tokens"] == 0
    assert srv.metric("doublesparse_requests_total", 'status="disconnected"') >= 2


def test_metrics_move(srv):
    before = {k: srv.metric(k) for k in ("doublesparse_generation_tokens_total",
                                         "doublesparse_prompt_tokens_total",
                                         "doublesparse_time_to_first_token_seconds_count",
                                         "doublesparse_e2e_request_latency_seconds_count",
                                         "doublesparse_decode_steps_total")}
    client(srv).completions.create(model=model_name(srv), prompt="Metrics", max_tokens=4,
                                   temperature=0, extra_body={"ignore_eos": True})
    after = {k: srv.metric(k) for k in before}
    assert after["doublesparse_generation_tokens_total"] - \
        before["doublesparse_generation_tokens_total"] == 4
    assert all(after[k] > before[k] for k in before), (before, after)
    text = httpx.get(srv.url + "/metrics", headers=AUTH).text
    for name in ("num_requests_running", "num_requests_waiting", "kv_pool_usage",
                 "sparse_decode_ratio", "time_per_output_token_seconds_bucket"):
        assert "doublesparse_" + name in text


# ------------------------------------------------------------------------------ fake-only
def test_full_kv_pool_queues_and_abort_while_waiting():
    """Pool of 600 slots, requests of ~310: one runs, the next waits; nothing fails."""
    s = fake_in_process({"max_total_tokens": 600, "step_delay": 0.004})
    try:
        body = {"prompt": "x" * 10, "max_tokens": 300, "ignore_eos": True}

        async def run():
            async with httpx.AsyncClient(base_url=s.url, headers=AUTH, timeout=60) as ac:
                rs = await asyncio.gather(*(ac.post("/v1/completions", json=body) for _ in range(3)))
            return rs

        t0 = time.time()
        rs = asyncio.run(run())
        assert [r.status_code for r in rs] == [200] * 3
        assert all(r.json()["usage"]["completion_tokens"] == 300 for r in rs)
        assert time.time() - t0 > 3 * 300 * 0.004 * 0.9  # they ran one after another
        # a request that can never fit is refused up front instead of waiting forever
        r = httpx.post(s.url + "/v1/completions", headers=AUTH,
                       json={"prompt": "x", "max_tokens": 700})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        # a waiting (not yet admitted) request that disconnects leaves the queue
        with httpx.stream("POST", s.url + "/v1/completions", headers=AUTH, timeout=60,
                          json={**body, "max_tokens": 585, "stream": True}) as first:
            lines = first.iter_lines()  # keep a reference: a collected iterator closes the stream
            next(lines)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(s.url + "/v1/completions", json=body, headers=AUTH, timeout=0.5)
            deadline = time.time() + 10
            while s.health()["waiting"] and time.time() < deadline:
                time.sleep(0.05)
            assert s.health()["waiting"] == 0 and s.health()["running"] == 1
        s.wait_idle()
    finally:
        s.stop()


def test_per_request_double_sparsity(srv):
    """Overrides the engine can honour pass through; others get a 400 that says why."""
    def post(**extra):
        return httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=120,
                          json={"prompt": "hi", "max_tokens": 2, **extra})
    if srv.kind == "fake":
        assert post(ds_heavy_token_num=64, enable_double_sparsity=True).status_code == 200
    else:  # the real server decodes with Double Sparsity, its default, and says so
        d = srv.health()["decode"]
        assert d["double_sparsity"] and d["heavy_token_num"] and "channel config" in d["channel_source"]
        assert d["channels_calibrated"] is True  # the packaged SmolLM2 config
        assert "calibrated" in d["operating_point"] and "r=16" in d["operating_point"]
        assert "length" in d["policy"] and "auto" in d["policy"]  # per-request budgets, auto choice
        k = d["heavy_token_num"]
        assert post(enable_double_sparsity=True).status_code == 200
        for extra in ({"ds_heavy_token_num": k}, {"enable_double_sparsity": False}):
            r = post(**extra)
            assert r.status_code == 400 and "not supported" in r.json()["error"]["message"], r.text
        assert srv.metric("doublesparse_decode_mode", 'double_sparsity="true"') == 1
    r = post(ds_heavy_token_num=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ds_heavy_token_num"


def test_per_request_double_sparsity_unsupported_engine_and_model_name():
    s = fake_in_process({"per_request_ds": False}, served_model_name="ds/tiny")
    try:
        c = client(s)
        assert [m.id for m in c.models.list().data] == ["ds/tiny"]
        assert c.models.retrieve("ds/tiny").id == "ds/tiny"
        with pytest.raises(openai.NotFoundError):
            c.models.retrieve("other")
        assert c.completions.create(model="ds/tiny", prompt="a", max_tokens=1).usage.total_tokens == 2
        r = httpx.post(s.url + "/v1/completions", headers=AUTH,
                       json={"prompt": "hi", "max_tokens": 2, "ds_heavy_token_num": 64})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"
        assert r.json()["error"]["param"] == "ds_heavy_token_num"
    finally:
        s.stop()


def test_engine_failure_fails_only_that_batch():
    s = fake_in_process({"fail_marker": "BOOM"})
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "BOOM", "max_tokens": 3},
                       headers=AUTH, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        with httpx.stream("POST", s.url + "/v1/completions", headers=AUTH, timeout=30,
                          json={"prompt": "BOOM", "max_tokens": 3, "stream": True}) as st:
            assert st.status_code == 500  # failed before the first token: still a clean status
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "fine", "max_tokens": 3},
                       headers=AUTH, timeout=30)
        assert r.status_code == 200 and s.health()["status"] == "ok"
        # failures in a row never leave the engine dead: each ends only its own request
        for _ in range(7):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "BOOM", "max_tokens": 3},
                           headers=AUTH, timeout=30)
            assert r.status_code == 500
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "fine", "max_tokens": 3},
                       headers=AUTH, timeout=30)
        assert r.status_code == 200 and s.health()["status"] == "ok"
        assert s.metric("doublesparse_engine_step_failures_total") >= 9
    finally:
        s.stop()


def test_sigterm_drains_accepted_requests():
    """One request streaming and one still queued for KV (pool fits one): both finish."""
    import threading

    s = Server(backend_args("fake", {"step_delay": 0.004, "max_total_tokens": 400}))
    body = {"prompt": "drain", "max_tokens": 300, "ignore_eos": True}
    queued: list = []
    got: list[str] = []
    with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True},
                      headers=AUTH, timeout=60) as r:
        it = r.iter_lines()
        got.append(next(it))
        t = threading.Thread(target=lambda: queued.append(
            httpx.post(s.url + "/v1/completions", json=body, headers=AUTH, timeout=60)))
        t.start()
        deadline = time.time() + 10
        while s.health()["waiting"] < 1 and time.time() < deadline:
            time.sleep(0.02)
        assert s.health()["waiting"] == 1
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        h = httpx.get(s.url + "/health", timeout=5)  # still answering while it drains
        assert h.status_code == 503 and h.json()["status"] == "draining"
        r = httpx.post(s.url + "/v1/completions", json=body, headers=AUTH, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        got.extend(it)
    t.join(30)
    data = [ln for ln in got if ln.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    assert json.loads(data[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert queued[0].status_code == 200 and queued[0].json()["usage"]["completion_tokens"] == 300
    assert s.proc.wait(30) == 0
