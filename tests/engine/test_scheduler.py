import ast
from pathlib import Path

import pytest

from doublesparse.config import SchedulerConfig
from doublesparse.engine.scheduler import RequestRefused, Scheduler


def make(cap=1000, ctx=512, chunk=64, max_run=8):
    return Scheduler(SchedulerConfig(max_running_requests=max_run, chunked_prefill_size=chunk), cap, ctx)


def test_no_torch_import():
    src = Path(__file__).resolve().parents[2] / "doublesparse" / "engine" / "scheduler.py"
    mods = {a.name for n in ast.walk(ast.parse(src.read_text())) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(ast.parse(src.read_text())) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m and m.split(".")[0] == "torch" for m in mods)


def test_single_request_prefill_then_decode():
    s = make()
    s.add("a", 10, 5)
    p = s.schedule()
    assert p.admitted == ("a",) and p.decode == ()
    assert [(c.rid, c.start, c.end, c.last) for c in p.prefill] == [("a", 0, 10, True)]
    assert s.reserved_tokens == 15
    p = s.schedule()
    assert p.prefill == () and p.decode == ("a",)
    assert s.finish("a") == "decode"
    assert s.reserved_tokens == 0 and not s.has_unfinished()
    assert s.schedule().empty


def test_chunked_prefill_and_budget_sharing():
    s = make(chunk=64)
    s.add("long", 150, 4)
    s.add("short", 20, 4)
    p = s.schedule()
    assert [(c.rid, c.start, c.end, c.last) for c in p.prefill] == [("long", 0, 64, False)]
    p = s.schedule()
    assert [(c.rid, c.start, c.end, c.last) for c in p.prefill] == [("long", 64, 128, False)]
    p = s.schedule()
    assert [(c.rid, c.start, c.end, c.last) for c in p.prefill] == [("long", 128, 150, True),
                                                                      ("short", 0, 20, True)]
    assert p.decode == ()
    p = s.schedule()
    assert p.decode == ("long", "short") and p.prefill == ()


def test_new_requests_join_between_decode_steps():
    s = make()
    s.add("a", 10, 100)
    s.schedule()
    assert s.schedule().decode == ("a",)
    s.add("b", 5, 10)
    p = s.schedule()
    assert p.decode == ("a",) and [c.rid for c in p.prefill] == ["b"]
    assert s.schedule().decode == ("a", "b")


def test_admission_waits_for_memory_fcfs():
    s = make(cap=100)
    s.add("a", 50, 30)        # reserves 80
    s.add("b", 30, 10)        # 40 > 20 free: waits
    s.add("c", 5, 5)          # would fit, but does not overtake b
    p = s.schedule()
    assert p.admitted == ("a",) and s.num_waiting == 2
    assert s.schedule().admitted == ()
    s.finish("a")
    p = s.schedule()
    assert p.admitted == ("b", "c")


def test_max_running_requests():
    s = make(max_run=2)
    for i in range(3):
        s.add(str(i), 4, 4)
    assert s.schedule().admitted == ("0", "1")
    assert s.num_running == 2 and s.num_waiting == 1
    s.finish("0")
    assert s.schedule().admitted == ("2",)


def test_refusals_are_clear():
    s = make(cap=100, ctx=512)
    with pytest.raises(RequestRefused, match="KV pool"):
        s.add("x", 90, 20)
    with pytest.raises(RequestRefused, match="maximum context length"):
        make(cap=10_000, ctx=64).add("x", 60, 10)
    with pytest.raises(RequestRefused, match="empty"):
        s.add("x", 0, 4)
    with pytest.raises(RequestRefused, match="max_new_tokens"):
        s.add("x", 4, -1)
    assert not s.has_unfinished()  # a refusal leaves nothing queued
    s.add("p", 4, 0)  # prefill only: reserves its prompt
    assert s.schedule().prefill[0].last and s.reserved_tokens == 4


def test_abort_waiting_and_running():
    s = make(cap=100)
    s.add("a", 60, 10)
    s.add("b", 60, 10)
    s.schedule()
    assert s.finish("b") == "waiting"
    assert s.finish("a") == "decode"
    assert s.reserved_tokens == 0
    assert s.finish("zzz") is None
    s.add("c", 1, 1)
    with pytest.raises(ValueError, match="already"):
        s.add("c", 1, 1)


# ------------------------------------------------------------------------------ cohort policy
def cohort(cap=1000, ctx=512, chunk=64, max_run=8):
    return Scheduler(SchedulerConfig(max_running_requests=max_run, chunked_prefill_size=chunk,
                                     prefill_schedule="cohort"), cap, ctx)


def chunks(p):
    return [(c.rid, c.start, c.end, c.last) for c in p.prefill]


def run_cohort(s, max_steps=1000):
    """Step to the end, finishing a request after its max_new_tokens decodes (first token at its
    last chunk); checks the budget every step. Returns the plans."""
    plans, made = [], {}
    for _ in range(max_steps):
        if not s.has_unfinished():
            return plans
        p = s.schedule()
        plans.append(p)
        assert p.num_prefill_tokens <= s.config.chunked_prefill_size
        assert not p.empty or p.admitted, "a step that does nothing: livelock"
        for c in p.prefill:
            made[c.rid] = made.get(c.rid, 0) + c.last
        for rid in p.decode:
            made[rid] += 1
        for rid, n in list(made.items()):
            if n == s.running[rid].max_new_tokens:
                s.finish(rid)
                del made[rid]
    raise AssertionError("did not finish")


def test_config_prefill_schedule_validated():
    from doublesparse.config import EngineConfig
    with pytest.raises(ValueError, match="prefill_schedule"):
        SchedulerConfig(prefill_schedule="tgi")
    with pytest.raises(ValueError, match="prefill_schedule"):
        EngineConfig(prefill_schedule="nope")
    assert EngineConfig(prefill_schedule="cohort").scheduler_config().prefill_schedule == "cohort"
    assert SchedulerConfig().prefill_schedule == "interleave"


def test_cohort_prefill_only_then_first_tokens_together():
    s = cohort(chunk=64)
    s.add("long", 150, 4)
    s.add("short", 20, 4)
    p = s.schedule()
    assert chunks(p) == [("long", 0, 64, False)] and p.decode == () and p.admitted == ("long",)
    p = s.schedule()
    assert chunks(p) == [("long", 64, 128, False)]
    p = s.schedule()                       # both held back at their last token
    assert chunks(p) == [("long", 128, 149, False), ("short", 0, 19, False)] and p.decode == ()
    p = s.schedule()                       # the whole cohort's last tokens in one step
    assert chunks(p) == [("long", 149, 150, True), ("short", 19, 20, True)] and p.decode == ()
    p = s.schedule()
    assert p.prefill == () and p.decode == ("long", "short")


def test_cohort_stalls_decodes_while_new_prompts_prefill():
    s = cohort(chunk=8)
    s.add("a", 4, 100)
    s.schedule()
    s.schedule()                           # a's last token: a decodes from now on
    assert s.schedule().decode == ("a",)
    s.add("b", 12, 10)
    s.add("c", 1, 10)                      # a 1-token prompt has only its last token
    p = s.schedule()
    assert chunks(p) == [("b", 0, 8, False)] and p.decode == () and p.admitted == ("b",)
    p = s.schedule()                       # c is admitted once there is budget again
    assert chunks(p) == [("b", 8, 11, False)] and p.decode == () and p.admitted == ("c",)
    p = s.schedule()
    assert chunks(p) == [("b", 11, 12, True), ("c", 0, 1, True)] and p.decode == ("a",)
    assert s.schedule().decode == ("a", "b", "c")


def test_cohort_budget_respected_for_last_tokens():
    s = cohort(chunk=3)
    for i in range(5):
        s.add(str(i), 2, 1)
    plans = run_cohort(s)
    lasts = [[c.rid for c in p.prefill if c.last] for p in plans]
    assert [x for x in lasts if x] == [["0", "1", "2"], ["3", "4"]]
    assert all(not p.decode for p in plans)   # max_new_tokens 1: done at the last chunk


def test_cohort_prompt_len_one():
    s = cohort()
    s.add("a", 1, 3)
    p = s.schedule()
    assert chunks(p) == [("a", 0, 1, True)] and p.admitted == ("a",) and p.decode == ()
    assert s.schedule().decode == ("a",)


def test_cohort_full_pool_does_not_block_decodes():
    s = cohort(cap=100, chunk=16)
    s.add("a", 40, 30)                     # reserves 70
    s.add("b", 40, 10)                     # 50 > 30 free: waits for a
    plans = [s.schedule() for _ in range(5)]
    assert [chunks(p)[-1][1:] for p in plans[:4]] == [(0, 16, False), (16, 32, False), (32, 39, False),
                                                       (39, 40, True)]
    assert plans[4].decode == ("a",) and s.num_waiting == 1   # b does not fit: a decodes
    s.finish("a")
    p = s.schedule()
    assert p.admitted == ("b",) and p.decode == ()


def test_cohort_max_running_does_not_block_decodes():
    s = cohort(max_run=1)
    s.add("a", 5, 3)
    s.add("b", 5, 3)
    s.schedule()
    s.schedule()
    assert s.schedule().decode == ("a",)


@pytest.mark.parametrize("seed", range(5))
def test_cohort_randomized_no_livelock(seed):
    import random
    rng = random.Random(seed)
    s = cohort(cap=300, chunk=rng.randrange(1, 20), max_run=rng.randrange(1, 6))
    for i in range(12):
        s.add(str(i), rng.randrange(1, 60), rng.randrange(1, 20))
    plans = run_cohort(s)
    assert s.reserved_tokens == 0
    for p in plans:   # a step with non-last prompt tokens never decodes
        assert not (p.decode and any(not c.last for c in p.prefill))


def test_interleave_unchanged_by_the_option():
    def trace(s):
        s.add("long", 150, 4)
        s.add("short", 20, 4)
        out = [s.schedule() for _ in range(3)]
        s.add("late", 5, 2)
        return out + [s.schedule() for _ in range(3)]
    a = trace(make(chunk=64))
    b = trace(Scheduler(SchedulerConfig(max_running_requests=8, chunked_prefill_size=64,
                                        prefill_schedule="interleave"), 1000, 512))
    assert a == b
    assert a[3].decode == ("long", "short") and chunks(a[3]) == [("late", 0, 5, True)]


def test_cohort_release_next():
    """True exactly when the next plan releases held-back last tokens (cohort schedule only)."""
    s = cohort(chunk=64)
    assert not s.cohort_release_next()          # nothing running
    s.add("a", 30, 2)
    assert not s.cohort_release_next()          # prompt work waiting
    assert chunks(s.schedule()) == [("a", 0, 29, False)]
    assert s.cohort_release_next()              # only a's last token left
    s.add("b", 10, 2)
    assert not s.cohort_release_next()          # an arrival that fits: its prompt comes first
    s.schedule()
    assert s.cohort_release_next()
    p = s.schedule()
    assert chunks(p) == [("a", 29, 30, True), ("b", 9, 10, True)]
    assert not s.cohort_release_next()          # both decode now
    i = Scheduler(SchedulerConfig(chunked_prefill_size=64), 1000, 512)
    i.add("a", 30, 2)
    i.schedule()
    assert not i.cohort_release_next()          # interleave: never


# ------------------------------------------------------------------------------ prefix cache
class Pool:
    """The engine's side of the scheduler's decisions on a fake pool of slots 1..cap (what
    engine/prefix_cache.py does on KVMemory): checks that no allocation ever fails and that every
    slot is accounted for (free, cached or privately held) after each step."""

    def __init__(self, s, prompts, max_new):
        self.s, self.prompts, self.max_new = s, prompts, max_new
        self.free = list(range(1, s.token_capacity + 1))
        self.rows, self.out = {}, {}

    def alloc(self, n):
        assert len(self.free) >= n, "the scheduler promised slots the pool does not have"
        got, self.free = self.free[:n], self.free[n:]
        return got

    def tokens(self, rid):  # greedy and deterministic: identical prompts give identical outputs
        p = self.prompts[rid]
        return p + [(sum(p) * 7 + i) % 50 for i in range(self.out[rid])]

    def step(self):
        s = self.s
        plan = s.schedule()
        for v in plan.evicted:
            self.free += list(v)
        for rid in plan.admitted:
            self.rows[rid], self.out[rid] = [], 0
        for h in plan.prefix_hits:
            self.rows[h.rid] = [v for piece in h.values for v in piece]
        for c in plan.prefill:
            assert len(self.rows[c.rid]) == c.start
            self.rows[c.rid] += self.alloc(c.num_tokens)
            self.out[c.rid] += c.last
        for rid in plan.decode:
            self.rows[rid] += self.alloc(1)
            self.out[rid] += 1
        for c in plan.prefill:
            remap = s.cache_prefill(c.rid, c.end, list(self.rows[c.rid][: c.end]))
            if remap is not None:
                row = self.rows[c.rid]
                self.free += row[remap.start : remap.stop]
                row[remap.start : remap.stop] = [v for p in remap.values for v in p][remap.start : remap.stop]
        for rid in [r for r, n in self.out.items() if n == self.max_new]:
            self.end(rid)
        self.check()
        return plan

    def end(self, rid):
        s, row = self.s, self.rows.pop(rid, None)
        if row is None:
            s.finish(rid)
            return
        n = len(row)
        shared, a, b = s.cache_finished(rid, self.tokens(rid)[:n], row)
        s.finish(rid)
        self.free += row[a:b] + row[shared:]
        del self.out[rid]

    def check(self):
        s = self.s
        s.cache.check()
        private = sum(len(r) - s.running[rid].cached for rid, r in self.rows.items())
        assert len(self.free) + s.cached_tokens + private == s.token_capacity
        assert s.cached_tokens + s.reserved_tokens <= s.token_capacity
        assert len(set(self.free)) == len(self.free)

    def run(self, max_steps=2000):
        for _ in range(max_steps):
            if not self.s.has_unfinished():
                break
            self.step()
        assert not self.s.has_unfinished()
        for v in self.s.flush_cache():
            self.free += list(v)
        assert sorted(self.free) == list(range(1, self.s.token_capacity + 1))


def test_prefix_hit_skips_cached_tokens_and_reserves_the_rest():
    s = make(cap=100, chunk=64)
    doc = list(range(1, 31))
    pool = Pool(s, {"a": doc + [40, 41], "b": doc + [50, 51, 52], "c": doc + [40, 41]}, max_new=3)
    s.add("a", 32, 3, pool.prompts["a"])
    while s.has_unfinished():
        pool.step()
    s.add("b", 33, 3, pool.prompts["b"])
    p = pool.step()
    assert p.prefix_hits[0].num_tokens == 30 and chunks(p) == [("b", 30, 33, True)]
    # matched tokens were never reserved, and once launched the rest of the prompt is cached too
    assert s.reserved_tokens == 3 and s.hit_tokens == 30
    s.add("c", 32, 3, pool.prompts["c"])  # identical to "a": all but the last prompt token
    p = pool.step()
    assert p.prefix_hits[0].num_tokens == 31 and chunks(p) == [("c", 31, 32, True)]
    pool.run()
    assert (s.hit_tokens, s.query_tokens) == (61, 97)


def test_same_prompt_admitted_together_is_deduplicated():
    s = make(cap=200, chunk=16)
    p = list(range(3, 40))
    pool = Pool(s, {"x": p, "y": p}, max_new=2)
    s.add("x", len(p), 2, p)
    s.add("y", len(p), 2, p)
    plan = pool.step()
    assert plan.prefix_hits == ()
    pool.run()


def test_eviction_makes_room_but_spares_held_prefixes():
    s = make(cap=60, chunk=64)
    shared = [9] * 20
    prompts = {"a": shared + [1] * 10, "b": [2] * 25, "c": shared + [3] * 10, "d": [4] * 30}
    pool = Pool(s, prompts, max_new=2)
    for rid in ("a", "b"):
        s.add(rid, len(prompts[rid]), 2, prompts[rid])
        while s.has_unfinished():
            pool.step()
    assert s.cached_tokens == 30 + 25 + 2 and s.evictable_tokens == s.cached_tokens
    s.add("c", 30, 20, prompts["c"])  # holds the shared 20; needs 30 more slots
    p = pool.step()
    assert p.prefix_hits[0].num_tokens == 20 and p.evicted  # b's and a's tail go, not the shared part
    assert s.cache.peek(shared)[0] == 20
    s.add("d", 30, 2, prompts["d"])  # does not fit while c runs: waits, nothing lost
    p = pool.step()
    assert "d" not in p.admitted and s.num_waiting == 1
    pool.run()


@pytest.mark.parametrize("schedule", ["interleave", "cohort"])
@pytest.mark.parametrize("seed", range(3))
def test_random_shared_prefix_workload(seed, schedule):
    """Groups of prompts sharing documents, a pool several times too small for all of them, aborts:
    the fake pool never runs dry, every slot is accounted for every step, all free at the end."""
    import random

    rng = random.Random(seed)
    s = Scheduler(SchedulerConfig(max_running_requests=4, chunked_prefill_size=rng.choice([7, 16, 40]),
                                  prefill_schedule=schedule), 120, 100)
    docs = [[rng.randrange(1, 50) for _ in range(rng.randrange(5, 50))] for _ in range(5)]
    prompts = {}
    for i in range(40):
        d = rng.choice(docs)
        prompts[str(i)] = d[: rng.randrange(1, len(d) + 1)] + [rng.randrange(50) for _ in range(rng.randrange(0, 8))]
    pool = Pool(s, prompts, max_new=3)
    pending = list(prompts)
    for _ in range(3000):
        for _ in range(rng.randrange(3)):
            if pending:
                rid = pending.pop(0)
                s.add(rid, len(prompts[rid]), 3, prompts[rid])
        if rng.random() < 0.05 and (s.running or s.waiting):
            victim = rng.choice([*s.running, *(w.rid for w in s.waiting)])
            pool.end(victim)  # abort: mid-prefill or mid-decode, its computed tokens stay cached
            pool.check()
        if not pending and not s.has_unfinished():
            break
        pool.step()
    pool.run()
    assert s.hit_tokens > 0


def test_disabled_cache_ignores_ids():
    s = Scheduler(SchedulerConfig(disable_radix_cache=True), 100, 100)
    s.add("a", 5, 2, [1, 2, 3, 4, 5])
    s.schedule()
    assert s.cache is None and s.cache_prefill("a", 5, [1, 2, 3, 4, 5]) is None
    assert s.cache_finished("a", [1, 2, 3, 4, 5], [1, 2, 3, 4, 5]) == (0, 0, 0)
    assert s.finish("a") == "decode" and s.flush_cache() == [] and s.reserved_tokens == 0
