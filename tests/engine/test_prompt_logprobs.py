"""Prompt logprobs (``SamplingParams.prompt_logprobs``) and prefill-only requests
(``max_new_tokens=0``): the numbers equal a full causal forward's log-softmax at every position,
through chunked prefill, the overlap schedule, mixed batches, Double Sparsity (its prefill is
dense) and the prefix cache (skipped by such requests); on the tiny random Llama and on the
embedded SmolLM2."""


import pytest
import torch

from doublesparse.engine import Engine
from doublesparse.testing import ByteTokenizer, tiny_llama
from model_utils import full_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, max_position_embeddings=512)


def engine(model, **kw):
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("ds_sparse_decode_threshold", 0)
    return Engine(model=model, tokenizer=ByteTokenizer(), progress=False, **kw)


def check(prompt_lps, ids, ref, k, atol=2e-4):
    assert len(prompt_lps) == len(ids) and prompt_lps[0] is None
    for p in range(1, len(ids)):
        lp, top = prompt_lps[p]
        assert lp == pytest.approx(float(ref[p - 1, ids[p]]), abs=atol), p
        assert len(top) == k
        want = ref[p - 1].topk(k)
        assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=atol)
        assert [i for i, _ in top][:1] == want.indices.tolist()[:1]


def prompts(n, seed=0, lo=5, hi=60):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 200, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("chunk", [4096, 7])
@pytest.mark.parametrize("ds", [False, True])
def test_prompt_logprobs_equal_full_forward(model, ds, chunk, overlap):
    kw = dict(enable_double_sparsity=True, ds_heavy_token_num=16, ds_heavy_channel_num=8) if ds else {}
    e = engine(model, chunked_prefill_size=chunk, **kw)
    e.overlap = overlap
    ps = prompts(4, seed=1, lo=1, hi=50) + [[5]]
    # mixed batch: some ask for prompt logprobs (one of them prefill-only), some do not
    sps = [{**GREEDY, "max_new_tokens": 4, "prompt_logprobs": 3},
           {**GREEDY, "max_new_tokens": 4},
           {**GREEDY, "max_new_tokens": 0, "prompt_logprobs": 0},
           {**GREEDY, "max_new_tokens": 3, "prompt_logprobs": 20, "logprobs": 2},
           {**GREEDY, "max_new_tokens": 2, "prompt_logprobs": 1}]
    out = e.generate(ps, sps)
    alone = engine(model).generate(ps[1], sps[1])[0]
    assert out[1]["token_ids"] == alone["token_ids"] and "prompt_logprobs" not in out[1]
    for i in (0, 2, 3, 4):
        check(out[i]["prompt_logprobs"], ps[i], full_logprobs(model, ps[i]), sps[i]["prompt_logprobs"])
    assert out[2]["token_ids"] == [] and out[2]["meta"]["finish_reason"] == "length"
    assert out[2]["meta"]["completion_tokens"] == 0 and out[2]["text"] == ""
    # the sampled tokens' own logprobs continue the prompt's
    ref3 = full_logprobs(model, ps[3] + out[3]["token_ids"])
    assert out[3]["logprobs"][0][0] == pytest.approx(float(ref3[len(ps[3]) - 1, out[3]["token_ids"][0]]),
                                                     abs=2e-4)
    s = e.stats()
    assert s["kv_used_tokens"] == 0 and s["kv_reserved_tokens"] == 0 and s["running"] == 0


def test_prefix_cache_is_skipped_not_wrong(model):
    """A request asking for prompt logprobs scores its whole prompt even when the prefix is
    cached (it does not read the cache), and does not fill it either."""
    e = engine(model)
    p = prompts(1, seed=3, lo=40, hi=41)[0]
    e.generate(p, {**GREEDY, "max_new_tokens": 2})                 # caches p
    r = e.generate(p + [9, 10], {**GREEDY, "max_new_tokens": 1, "prompt_logprobs": 2})[0]
    assert r["meta"]["cached_tokens"] == 0
    check(r["prompt_logprobs"], p + [9, 10], full_logprobs(model, p + [9, 10]), 2)
    hits = e.stats()["prefix_cache_hit_tokens"]
    again = e.generate(p + [9, 10, 11], {**GREEDY, "max_new_tokens": 1})[0]
    assert again["meta"]["cached_tokens"] == len(p)  # the first request's, not the scoring one's
    assert e.stats()["prefix_cache_hit_tokens"] == hits + len(p)


def test_prefill_only_without_logprobs_fills_the_cache(model):
    e = engine(model)
    p = prompts(1, seed=4, lo=30, hi=31)[0]
    r = e.generate(p, {**GREEDY, "max_new_tokens": 0})[0]
    assert r["token_ids"] == [] and r["meta"]["finish_reason"] == "length"
    nxt = e.generate(p + [7], {**GREEDY, "max_new_tokens": 1})[0]
    assert nxt["meta"]["cached_tokens"] == len(p)


def test_abort_while_scoring(model):
    e = engine(model, chunked_prefill_size=8)
    rid = e.add_request(prompts(1, seed=5, lo=40, hi=41)[0], {**GREEDY, "max_new_tokens": 0,
                                                              "prompt_logprobs": 1})
    e.step()
    e.abort(rid)
    outs = []
    while e.has_unfinished():
        outs += e.step()
    assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [(rid, "abort")]
    assert e.stats()["kv_used_tokens"] == 0


# ------------------------------------------------------------------------- embedded SmolLM2
def _smollm2() -> None:
    try:
        from doublesparse.assets import smollm2_gguf_path
        smollm2_gguf_path()
    except Exception:
        pytest.skip("embedded SmolLM2 unavailable")


def test_smollm2_prompt_logprobs_dense_and_ds():
    """As served on the CPU (packed weights): the prompt's logprobs are the float32 LM head's, not
    its bf16 copy's, and Double Sparsity changes nothing (its prefill is dense)."""
    _smollm2()
    kw = dict(device="cpu", max_total_tokens=2048, context_length=2048, progress=False)
    dense = Engine(enable_double_sparsity=False, chunked_prefill_size=9, **kw)
    assert dense.parts.model.lm_head.packed is not None  # the copy the exact rows bypass
    ids = dense.tokenizer.encode("To be, or not to be, that is the question: Whether 'tis nobler in "
                                 "the mind to suffer the slings and arrows of outrageous fortune")
    sp = {**GREEDY, "max_new_tokens": 0, "prompt_logprobs": 5}
    out = dense.generate(ids, sp)[0]
    check(out["prompt_logprobs"], ids, full_logprobs(dense.parts.model, ids, exact=True), 5, atol=1e-3)
    ds = Engine(enable_double_sparsity=True, ds_heavy_token_num=16, ds_sparse_decode_threshold=0, **kw)
    got = ds.generate(ids, sp)[0]["prompt_logprobs"]
    assert [e[0] for e in got[1:]] == pytest.approx([e[0] for e in out["prompt_logprobs"][1:]], abs=1e-4)
    # and the first sampled token of a scoring request is the same as without scoring
    a = dense.generate(ids, {**GREEDY, "max_new_tokens": 3})[0]
    b = dense.generate(ids, {**GREEDY, "max_new_tokens": 3, "prompt_logprobs": 1})[0]
    assert a["token_ids"] == b["token_ids"]
