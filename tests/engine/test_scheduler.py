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
        s.add("x", 4, 0)
    assert not s.has_unfinished()  # a refusal leaves nothing queued


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
