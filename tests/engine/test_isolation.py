"""One request can never harm another: validation of what the sampler can represent, and a
failure traced to the request that caused it while the rest of its batch goes on."""

import math

import pytest
import torch

from doublesparse.engine import Engine, SamplingParams
from doublesparse.engine import sampler as sampling_mod
from doublesparse.engine.sampler import filter_probs, make_generator, sample
from doublesparse.engine.sampling_params import TOP_K_MAX, TOP_P_MIN
from doublesparse.testing import ByteTokenizer, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kw,msg", [
    (dict(top_k=2**70), "top_k"),
    (dict(top_k=TOP_K_MAX + 1), "top_k"),
    (dict(top_p=1e-300), "float32"),
    (dict(temperature=math.nan), "finite"),
    (dict(temperature=math.inf), "finite"),
    (dict(top_p=math.nan), "finite"),
    (dict(seed=2**64), "seed"),
    (dict(max_new_tokens=2**64), "max_new_tokens"),
    (dict(stop_token_ids=[2**64]), "stop_token_ids"),
])
def test_refuses_what_the_sampler_cannot_represent(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_representable_extremes_sample():
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    ps = [SamplingParams(temperature=0.8, top_k=TOP_K_MAX), SamplingParams(temperature=0.8, top_p=TOP_P_MIN),
          SamplingParams(temperature=1e-300, top_p=0.5)]
    out = sample(x, ps, [make_generator(i, "cpu") for i in range(3)])
    assert out.shape == (3,) and int(out[1]) == int(x[1].argmax()) and int(out[2]) == int(x[2].argmax())


def test_filter_never_empties_a_row():
    x = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    probs, _ = filter_probs(x, torch.ones(4), torch.zeros(4), torch.zeros(4, dtype=torch.int64))
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(4))
    assert torch.equal(probs[:, 0], torch.ones(4))


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, max_position_embeddings=512)


def _engine(model, overlap):
    e = Engine(model=model, tokenizer=ByteTokenizer(), progress=False, max_total_tokens=2048,
               max_running_requests=8)
    e.overlap = overlap
    return e


def _run(e, reqs):
    """reqs: [(ids, params)] -> {rid: (token_ids, meta)} after every request finished."""
    rids = [e.add_request(ids, sp) for ids, sp in reqs]
    got = {r: [] for r in rids}
    metas = {}
    while e.has_unfinished():
        for o in e.step():
            got[o.request_id] += o.new_token_ids
            if o.finished:
                metas[o.request_id] = o.meta
    return [(got[r], metas[r]) for r in rids]


@pytest.mark.parametrize("overlap", [False, True])
def test_sampling_failure_ends_only_its_request(model, overlap, monkeypatch):
    poison = 4242  # seed that the patched sampler cannot handle

    def flaky(logits, params, generators):
        if any(p.seed == poison for p in params):
            raise RuntimeError("injected sampling failure")
        return sample(logits, params, generators)

    a, b = [5, 6, 7, 8, 9], [11, 12, 13]
    alone = _run(_engine(model, overlap), [(a, dict(max_new_tokens=6, **GREEDY))])[0][0]
    monkeypatch.setattr(sampling_mod, "sample", flaky)
    e = _engine(model, overlap)
    (ok, ok_meta), (bad, bad_meta) = _run(e, [(a, dict(max_new_tokens=6, **GREEDY)),
                                              (b, dict(max_new_tokens=6, temperature=0.7, seed=poison))])
    assert ok == alone and ok_meta["finish_reason"] == "length"
    assert bad_meta["finish_reason"] == "error" and "injected sampling failure" in bad_meta["error"]
    e.flush_cache()  # finished requests leave their tokens in the prefix cache
    assert e.parts.memory.slots.num_used == 0 and e.stats()["failed_requests"] == 1


@pytest.mark.parametrize("overlap", [False, True])
def test_failed_step_resets_and_serves_on(model, overlap, monkeypatch):
    e = _engine(model, overlap)
    real = e.parts.runner.decode
    calls = {"n": 0}

    def broken_once(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected step failure")
        return real(*a, **k)

    monkeypatch.setattr(e.parts.runner, "decode", broken_once)
    rids = [e.add_request([3, 4, 5, 6], dict(max_new_tokens=8, **GREEDY)) for _ in range(2)]
    ended = {}
    with pytest.raises(RuntimeError, match="injected"):
        while True:
            for o in e.step():
                ended[o.request_id] = o
    for o in e.fail_running(RuntimeError("injected step failure")):
        ended[o.request_id] = o
    assert {r: ended[r].finish_reason for r in rids} == {r: "error" for r in rids}
    assert e.parts.memory.slots.num_used == 0 and not e.has_unfinished()
    assert e.stats()["failed_steps"] == 1
    (toks, meta), = _run(e, [([3, 4, 5, 6], dict(max_new_tokens=4, **GREEDY))])
    assert meta["finish_reason"] == "length" and len(toks) == 4
    e.flush_cache()
    assert e.parts.memory.slots.num_used == 0
