"""The engine with the prefix cache against the same engine without it (tiny random Llama, CPU):
greedy tokens identical, cached tokens skipped, the pool empty again after every test."""

import pytest
import torch

from doublesparse.engine import Engine
from doublesparse.testing import ByteTokenizer, tiny_llama

GREEDY = {"temperature": 0.0, "ignore_eos": True}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3, max_position_embeddings=512)


def engine(model, overlap=False, **kw):
    kw.setdefault("max_total_tokens", 1024)
    kw.setdefault("max_running_requests", 4)
    kw.setdefault("chunked_prefill_size", 16)
    kw.setdefault(
        "ds_sparse_decode_threshold", 0
    )  # a toy model: run the sparse kernels anyway
    e = Engine(model=model, tokenizer=ByteTokenizer(), progress=False, **kw)
    e.overlap = overlap  # CPU default is off; forced to test the GPU default's logic
    return e


def ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (n,), generator=g).tolist()


def run(e, waves):
    """Each wave: [(prompt, max_new_tokens)], added together once the previous wave finished.
    Returns, per request in order, (token ids, meta)."""
    out = []
    for wave in waves:
        rids = [e.add_request(p, {**GREEDY, "max_new_tokens": n}) for p, n in wave]
        got, meta = {r: [] for r in rids}, {}
        while e.has_unfinished():
            for o in e.step():
                got[o.request_id] += o.new_token_ids
                if o.finished:
                    meta[o.request_id] = o.meta
        out += [(got[r], meta[r]) for r in rids]
    return out


def assert_empty(e):
    """Once the cache is flushed, every slot and row is free and nothing is reserved."""
    e.flush_cache()
    m, s = e.parts.memory, e.parts.scheduler
    assert m.slots.num_free == m.slots.size and m.rows.num_free == m.rows.size
    assert s.reserved_tokens == 0 and s.cached_tokens == 0 and not e.has_unfinished()
    assert int(m.req_to_token_host.count_nonzero()) == 0


DOC = ids(37, 1)
Q = [ids(n, 10 + n) for n in (5, 9, 3)]
WAVES = [
    [
        (DOC + Q[0], 6),
        (DOC + Q[1], 4),
        (DOC + Q[0], 6),
    ],  # cold, together: one copy survives
    [
        (DOC + Q[2], 5),
        (DOC + Q[1], 7),
        (DOC[:21], 4),
    ],  # a new question, a repeat, a prefix of it
    [(ids(30, 2), 5), (DOC + Q[0] + [7, 8], 3)],  # unrelated; a follow-up turn
]


@pytest.mark.parametrize(
    "ds,schedule,overlap",
    [
        (False, "interleave", False),
        (True, "interleave", True),
        (False, "cohort", True),
        (True, "cohort", False),
    ],
)
def test_shared_prefix_batches_equal_without_cache(model, ds, schedule, overlap):
    kw = {"prefill_schedule": schedule}
    if ds:
        kw.update(enable_double_sparsity=True, ds_heavy_token_num=16)
    ref = run(engine(model, overlap, disable_radix_cache=True, **kw), WAVES)
    e = engine(model, overlap, **kw)
    got = run(e, WAVES)
    assert [t for t, _ in got] == [t for t, _ in ref]
    cached = [m["cached_tokens"] for _, m in got]
    # the first wave is admitted as the prefill budget allows: later ones reuse what was launched
    assert cached[0] == 0 and cached[1] % 16 == 0 and cached[2] > 0
    assert (
        cached[3] == 37 and cached[4] == 37 + 9 - 1
    )  # a repeat: all but its last token
    assert cached[5] == 20  # a prompt wholly cached still computes its last token
    assert cached[6] == 0 and cached[7] >= len(
        DOC + Q[0]
    )  # the first turn's prompt and output
    if ds:
        assert all(m["sparse_decode_steps"] > 0 for _, m in got)
    st = e.stats()
    assert st["prefix_cache_hit_tokens"] == sum(cached)
    assert st["prefix_cache_query_tokens"] == sum(len(p) for w in WAVES for p, _ in w)
    assert st["kv_used_tokens"] == 0 and st["kv_cached_tokens"] > 0
    assert_empty(e)


def test_prefix_ending_inside_a_prefill_chunk_skips_its_tokens(model):
    e = engine(model, chunked_prefill_size=8)
    ref = run(
        engine(model, chunked_prefill_size=8, disable_radix_cache=True),
        [[(DOC[:21], 3)], [(DOC, 4)]],
    )
    got = run(e, [[(DOC[:21], 3)], [(DOC, 4)]])
    assert [t for t, _ in got] == [t for t, _ in ref]
    # 21 prompt tokens + 2 outputs with K/V; the prompt diverges from DOC after the 21
    assert got[1][1]["cached_tokens"] == 21
    assert e.stats()["prefill_tokens"] == 21 + (37 - 21)
    assert_empty(e)


def stream(e, arrivals, on_step=None):
    """Add ``arrivals[i]`` (a list of (prompt, max_new_tokens)) before step i; step to the end.
    Returns each request's token ids, in order of arrival."""
    rids, got, i = [], {}, 0
    while i < len(arrivals) or e.has_unfinished():
        for p, n in arrivals[i] if i < len(arrivals) else ():
            rids.append(e.add_request(p, {**GREEDY, "max_new_tokens": n}))
            got[rids[-1]] = []
        for o in e.step():
            got[o.request_id] += o.new_token_ids
        if on_step:
            on_step(rids)
        i += 1
    return [got[r] for r in rids]


def test_eviction_while_another_request_holds_a_shared_node(model):
    """A pool of 120 slots: the long request holds DOC + its question (46) and 40 more slots for
    its output, while short requests churn through the rest; admitting them evicts older cached
    prompts, never the held prefix. Then a request on DOC still reuses it."""
    held = DOC + Q[1]
    arrivals = (
        [[(held, 40)], [], [], [], [(ids(20, 4), 3)]]
        + [[]] * 5
        + [[(ids(21, 5), 3)]]
        + [[]] * 5
        + [[(ids(22, 6), 3), (DOC + Q[2], 3)]]
    )
    e = engine(model, max_total_tokens=120, max_running_requests=3)
    sched = e.parts.scheduler

    def check(rids):
        if rids[0] in sched.running and sched.running[rids[0]].num_prefilled == len(
            held
        ):
            assert sched.cache.peek(held)[0] == len(held)

    got = stream(e, arrivals, check)
    ref = stream(engine(model, disable_radix_cache=True), arrivals)
    assert got == ref
    assert e.stats()["prefix_cache_evicted_tokens"] > 0, (
        "the churn must have evicted cached prompts"
    )
    assert sched.hit_tokens >= len(DOC)  # DOC + Q[2] reused DOC
    assert_empty(e)


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_mid_prefill_leaves_its_computed_prefix(model, overlap):
    e = engine(model, overlap, chunked_prefill_size=8)
    p = DOC + Q[0]
    rid = e.add_request(p, {**GREEDY, "max_new_tokens": 5})
    e.step()
    e.step()  # two 8-token chunks launched
    e.abort(rid)
    while e.has_unfinished():
        e.step()
    assert e.parts.scheduler.cache.total_size == 16
    ((toks, meta),) = run(e, [[(p, 5)]])
    assert meta["cached_tokens"] == 16
    ((ref, _),) = run(
        engine(model, chunked_prefill_size=8, disable_radix_cache=True), [[(p, 5)]]
    )
    assert toks == ref
    assert_empty(e)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v2"])
@pytest.mark.parametrize("ds", [False, True], ids=["dense", "ds"])
def test_moe_and_mla_families_with_the_cache(arch, ds):
    """The MoE families and DeepSeek-V2's latent pools (one 576-wide row per token, its labels
    from the latent) reuse cached prefixes as Llama does: the same greedy tokens as without."""
    from doublesparse.testing import tiny_family

    m = tiny_family(arch, max_position_embeddings=512)
    kw = dict(enable_double_sparsity=True, ds_heavy_token_num=16) if ds else {}
    ref = run(engine(m, disable_radix_cache=True, **kw), WAVES)
    e = engine(m, **kw)
    got = run(e, WAVES)
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert e.stats()["prefix_cache_hit_tokens"] > 100
    assert_empty(e)
