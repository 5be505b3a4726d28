"""Property-based fuzzing of the HTTP endpoints: arbitrary JSON bodies never get a 5xx, and a
stream and a /generate with a client rid running meanwhile finish untouched, while the burst also
reuses that rid and drops fanned-out requests mid-flight."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_utils import AUTH, fake_in_process

FIELDS = ["prompt", "messages", "text", "input_ids", "sampling_params", "model", "max_tokens",
          "max_completion_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "n", "seed",
          "stop", "stream", "stream_options", "presence_penalty", "frequency_penalty", "ignore_eos",
          "stop_token_ids", "enable_double_sparsity", "ds_heavy_token_num", "logprobs",
          "top_logprobs", "echo", "tools", "best_of", "suffix", "rid", "role", "content",
          "repetition_penalty", "min_p", "logit_bias", "min_tokens", "min_new_tokens",
          "skip_special_tokens", "response_format", "json_schema", "regex", "ebnf", "guided_json",
          "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "json",
          "choice", "grammar", "json_object", "use_beam_search", "user", "no_stop_trim"]
SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.integers(-3, 40)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4)
                      | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), c, max_size=4),
                      max_leaves=12)
BODIES = st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=6)
PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate"])


@pytest.fixture(scope="module")
def fake_server():
    s = fake_in_process()
    yield s
    s.stop()


def _post_checked(server, path: str, body: dict) -> None:
    raw = json.dumps(body, allow_nan=True).encode()
    r = httpx.post(server.url + path, content=raw, headers=AUTH, timeout=30)
    assert r.status_code < 500, (path, raw[:300], r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=PATHS, body=BODIES)
def test_arbitrary_json_never_5xx(fake_server, path, body):
    _post_checked(fake_server, path, body)


def test_fuzzing_leaves_a_concurrent_stream_intact(fake_server):
    """A long stream runs while a burst of hypothesis bodies hits the server."""
    got = {}

    def stream():
        body = {"prompt": "A long story:", "max_tokens": 300, "ignore_eos": True, "stream": True,
                "temperature": 0}
        with httpx.stream("POST", fake_server.url + "/v1/completions", json=body, headers=AUTH,
                          timeout=120) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
        got["finish"] = json.loads(lines[-1][6:])["choices"][0]["finish_reason"]

    def original():  # a /generate whose rid the burst's collisions reuse
        body = {"text": "keep", "rid": "fuzz-rid", "sampling_params": {
            "max_new_tokens": 200, "ignore_eos": True, "temperature": 0}}
        r = httpx.post(fake_server.url + "/generate", json=body, headers=AUTH, timeout=120)
        got["rid"] = r.json()["meta_info"]["completion_tokens"]

    ts = [threading.Thread(target=stream), threading.Thread(target=original)]
    for t in ts:
        t.start()

    def hit(path, body):
        _post_checked(fake_server, path, body)
        if body.get("rid") is not None:  # and a collision with the running original
            _post_checked(fake_server, "/generate", {**body, "rid": "fuzz-rid"})
        if isinstance(body.get("n"), int) and 1 < body["n"] <= 40:  # a fan-out whose client leaves
            try:
                httpx.post(fake_server.url + "/v1/completions", headers=AUTH, timeout=0.05,
                           json={"prompt": ["x", "y"], "n": body["n"], "max_tokens": 300,
                                 "ignore_eos": True})
            except httpx.TimeoutException:
                pass

    burst = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))(
        given(path=PATHS, body=BODIES)(hit))
    burst()
    for t in ts:
        t.join(120)
    assert got.get("finish") == "length" and got.get("rid") == 200
    assert fake_server.health()["status"] == "ok"
    fake_server.wait_idle(timeout=30)  # every dropped fan-out left the engine


TINY = st.sampled_from([5e-38, 1e-45, 1e-300, 1e-7, 1e-6, 1e6, 3e38, 1e300])
SAMPLING = st.fixed_dictionaries({}, optional={
    "temperature": SCALARS | TINY, "top_p": SCALARS | TINY, "top_k": SCALARS, "seed": SCALARS,
    "max_new_tokens": SCALARS, "stop_token_ids": st.lists(st.integers(-2**70, 2**70), max_size=3),
    "repetition_penalty": SCALARS | TINY, "min_p": SCALARS | TINY,
    "frequency_penalty": SCALARS | TINY, "presence_penalty": SCALARS | TINY,
    "min_tokens": SCALARS, "logit_bias": st.dictionaries(st.integers(-3, 60) | st.text(max_size=3),
                                                        SCALARS | TINY, max_size=4)})


@settings(max_examples=300, deadline=None)
@given(kw=SAMPLING)
def test_sampling_params_either_refused_or_sampleable(kw):
    """What SamplingParams accepts (and the engine, which refuses logit_bias ids past the
    vocabulary), the batched sampler can run after the penalties, biases and min_tokens' masks
    (with another request beside it), on logits as large as a model's: no inf/NaN
    probabilities."""
    from types import SimpleNamespace

    import torch

    from doublesparse.engine.sampler import RequestSampling, apply_penalties, make_generator, sample_requests
    from doublesparse.engine.sampling_params import SamplingParams

    try:
        p = SamplingParams(**{k: v for k, v in kw.items() if v is not None})
    except ValueError:
        return
    if any(i >= 50 for i, _ in p.logit_bias):
        return
    logits = 40 * torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    params = [p, SamplingParams(temperature=0.7, seed=1)]
    f32 = [[float(getattr(q, f)) for q in params] for f in
           ("repetition_penalty", "frequency_penalty", "presence_penalty")]
    counts = torch.zeros(2, 50)
    counts[:, :10] = 3
    logits = apply_penalties(logits, counts, torch.zeros(2, 50, dtype=torch.bool),
                             *(torch.tensor(v, dtype=torch.float32) for v in f32))
    reqs = [SimpleNamespace(params=q, generator=None if q.greedy else make_generator(q.seed or 0, "cpu"),
                            sampling=RequestSampling(q, [1, 2], 50, "cpu", stop_ids=(0, 3)))
            for q in params]
    out, _ = sample_requests(logits, reqs)
    assert out.shape == (2,) and 0 <= int(out.min()) and int(out.max()) < 50
    if p.min_tokens:
        assert int(out[0]) not in (0, 3)
