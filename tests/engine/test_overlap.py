"""The engine's overlap schedule (launch step n+1, then read step n's tokens) against the plain
one: same tokens, same finish reasons, every slot freed, outputs one step later."""

import pytest
import torch

from doublesparse.engine import Engine
from doublesparse.testing import ByteTokenizer, tiny_llama

GREEDY = dict(temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=1, max_position_embeddings=512)


def engine(model, overlap, **kw):
    kw.setdefault("max_total_tokens", 2048)
    kw.setdefault("max_running_requests", 3)
    kw.setdefault("ds_sparse_decode_threshold", 0)  # a toy model: run the sparse kernels anyway
    e = Engine(model=model, tokenizer=ByteTokenizer(), progress=False,
               disable_overlap_schedule=not overlap, **kw)
    assert not e.overlap  # CPU: off by default (every launch runs at once, nothing to overlap)
    e.overlap = overlap   # forced here, to test the GPU default's logic
    return e


def run_all(e, reqs):
    """Feed requests, step to the end; returns per request (token ids, finish reason, decode
    steps, sparse decode steps) and the number of steps."""
    rids = [e.add_request(p, sp) for p, sp in reqs]
    got = {r: [] for r in rids}
    fin = {}
    steps = 0
    while e.has_unfinished():
        for o in e.step():
            got[o.request_id] += o.new_token_ids
            if o.finished:
                assert o.request_id not in fin, "finished twice"
                fin[o.request_id] = (o.finish_reason, o.meta["decode_steps"], o.meta["sparse_decode_steps"])
        steps += 1
        assert steps < 1000
    return [(got[r], *fin[r]) for r in rids], steps


@pytest.mark.parametrize("ds", [False, True])
def test_overlap_matches_plain_schedule(model, ds):
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(1, 128, (int(n),), generator=g).tolist() for n in (9, 40, 23, 61, 5, 33)]
    first = engine(model, False).generate(ps[1], {**GREEDY, "max_new_tokens": 12})[0]["token_ids"]
    sps = [
        {**GREEDY, "max_new_tokens": 7},
        {**GREEDY, "max_new_tokens": 12, "stop_token_ids": [first[4]]},   # stops at a token id
        {"temperature": 0.8, "top_p": 0.9, "seed": 11, "max_new_tokens": 9, "ignore_eos": True},
        {**GREEDY, "max_new_tokens": 1},
        {"temperature": 1.0, "top_k": 5, "seed": 2, "max_new_tokens": 15, "ignore_eos": True},
        {**GREEDY, "max_new_tokens": 20},
    ]
    kw = dict(enable_double_sparsity=ds, ds_heavy_token_num=8, chunked_prefill_size=16) if ds else {}
    e0 = engine(model, False, **kw)
    plain, _ = run_all(e0, list(zip(ps, sps)))
    e = engine(model, True, **kw)
    over, _ = run_all(e, list(zip(ps, sps)))
    assert over == plain   # tokens, finish reasons, and per-request (sparse) decode step counts
    assert plain[1][1] == "stop" and len(plain[1][0]) <= 5 and plain[3][1] == "length"
    assert all(steps == len(toks) - 1 for toks, _, steps, _ in over)
    s, s0 = e.stats(), e0.stats()
    assert s["kv_used_tokens"] == 0 and s["running"] == 0 and s["kv_reserved_tokens"] == 0
    # (engine-wide step counts may differ: with the lag, a freed request's place is taken a step later)
    for key in ("decode_tokens", "generation_tokens"):
        assert s[key] == s0[key], key


def test_overlap_outputs_lag_one_step_and_stop_frees_extra_slot(model):
    e = engine(model, True)
    p = list(range(20, 40))
    ref = engine(model, False).generate(p, {**GREEDY, "max_new_tokens": 12})[0]["token_ids"]
    i = next(i for i in range(2, 12) if ref[i] not in ref[:i])   # the first new token from the 3rd
    rid = e.add_request(p, {**GREEDY, "max_new_tokens": 12, "stop_token_ids": [ref[i]]})
    assert e.step() == []                         # prefill launched, its token not read yet
    outs = e.step()                               # first decode launched, first token out
    assert [o.new_token_ids for o in outs] == [[ref[0]]]
    for _ in range(i):
        outs = e.step()
    assert outs[0].finished and outs[0].new_token_ids == [ref[i]]   # the stop token
    assert outs[0].meta["decode_steps"] == i
    # the request was already in the next step: that token is dropped, its slot freed, and
    # nothing is left to wait for
    assert not e.has_unfinished() and e.step() == []
    assert e.stats()["kv_used_tokens"] == 0 and rid not in e._reqs


def test_abort_during_overlap(model):
    e = engine(model, True)
    rid = e.add_request([3] * 20, {**GREEDY, "max_new_tokens": 50})
    other = e.add_request([4] * 12, {**GREEDY, "max_new_tokens": 8})
    for _ in range(4):
        e.step()
    e.abort(rid)                                   # a step of it is still in flight
    done = {}
    while e.has_unfinished():
        for o in e.step():
            if o.finished:
                done[o.request_id] = o.finish_reason
    assert done == {rid: "abort", other: "length"}
    assert e.stats()["kv_used_tokens"] == 0
    alone = engine(model, False).generate([4] * 12, {**GREEDY, "max_new_tokens": 8})[0]["token_ids"]
    e2 = engine(model, True)
    assert e2.generate([4] * 12, {**GREEDY, "max_new_tokens": 8})[0]["token_ids"] == alone
    assert not e2.has_unfinished()


@pytest.mark.parametrize("seed", range(6))
def test_overlap_randomized(model, seed):
    """Random mixes (prompt lengths, greedy or seeded sampling, stop ids and strings, a tight pool,
    small chunks, staggered arrivals): the same tokens and finish reasons as the plain schedule, and
    every slot, reservation and row freed. A run with aborts keeps the same bookkeeping."""
    import random
    rng = random.Random(seed)
    reqs = []
    for j in range(6):
        p = [rng.randrange(32, 127) for _ in range(rng.randrange(1, 40))]
        sp = dict(max_new_tokens=rng.randrange(1, 20), ignore_eos=rng.random() < 0.5)
        sp.update(temperature=0.0) if rng.random() < 0.5 else sp.update(temperature=1.0, seed=rng.randrange(100))
        if rng.random() < 0.4:
            sp["stop_token_ids"] = [rng.randrange(0, 256) for _ in range(20)]
        if rng.random() < 0.4:
            sp["stop"] = [chr(rng.randrange(32, 127)) for _ in range(3)]
        reqs.append((f"r{j}", p, sp))
    aborts = {rng.randrange(0, 30): f"r{rng.randrange(6)}" for _ in range(3)}

    def run(overlap, abort_at):
        e = engine(model, overlap, max_total_tokens=200, chunked_prefill_size=16)
        pending, got, fin, step = list(reqs), {}, {}, 0
        while pending or e.has_unfinished():
            if pending and random.Random(step).random() < 0.5:
                rid, p, sp = pending.pop(0)
                e.add_request(p, sp, request_id=rid)
                got[rid] = []
            if step in abort_at:
                e.abort(abort_at[step])
            for o in e.step():
                assert o.request_id not in fin, "finished twice"
                got[o.request_id] += o.new_token_ids
                if o.finished:
                    fin[o.request_id] = (o.finish_reason, o.text, o.completion_tokens)
            step += 1
            assert e.parts.memory.slots.num_used <= 200
        s = e.stats()
        assert s["kv_used_tokens"] == 0 and s["kv_reserved_tokens"] == 0
        assert e.parts.memory.rows.num_free == 3
        return got, fin

    assert run(True, {}) == run(False, {})
    run(True, aborts)
