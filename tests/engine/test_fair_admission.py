"""Fair admission across groups (a fanned-out request's siblings share one), in the plain-Python
scheduler alone: round robin over groups, FCFS within a group, the last running slot kept for a
group with nothing running, and O(1) removal of waiting requests."""

from doublesparse.config import SchedulerConfig
from doublesparse.engine.scheduler import FairQueue
from doublesparse.engine.scheduler import Scheduler


def make(max_run=4, cap=100_000, chunk=10_000):
    return Scheduler(SchedulerConfig(max_running_requests=max_run, chunked_prefill_size=chunk,
                                     disable_radix_cache=True), cap, 512)


def test_fair_queue_round_robin_order_and_removal():
    q = FairQueue()
    for i in range(3):
        q.add(f"a{i}", "A", f"a{i}")
    q.add("b0", "B", "b0")
    q.add("c0", "C", "c0")
    q.add("c1", "C", "c1")
    assert list(q) == ["a0", "b0", "c0", "a1", "c1", "a2"]
    assert q.head() == "a0" and q.take("a0") == "a0"
    assert q.head() == "b0"                      # A went to the back after its admission
    assert q.head(skip=lambda g: g == "B") == "c0"
    q.remove("c0")                               # an abort: the order of the rest is unchanged
    assert list(q) == ["b0", "c1", "a1", "a2"] and len(q) == 4 and "c0" not in q
    assert q.get("a2") == "a2" and q.num_groups == 3


def test_newcomer_behind_a_large_fanout_is_admitted_next():
    s = make(max_run=4)
    for i in range(1000):
        s.add(f"f{i}", 8, 4, group="fan")
    p = s.schedule()
    # a lone fan-out leaves the last slot free...
    assert p.admitted == ("f0", "f1", "f2") and s.num_running == 3
    s.add("solo", 8, 4)
    p = s.schedule()
    # ... so a request arriving behind 997 waiting siblings runs at the next step
    assert p.admitted == ("solo",)
    for rid in ("f0", "f1", "f2", "solo"):
        s.finish(rid)
    s.add("late", 8, 4)
    p = s.schedule()
    # round robin: the fan-out's next sibling, then the newcomer, then the fan-out again
    assert p.admitted == ("f3", "late", "f4")


def test_two_fanouts_alternate_and_plain_requests_stay_fcfs():
    s = make(max_run=64)
    for i in range(5):
        s.add(f"a{i}", 4, 2, group="A")
    for i in range(5):
        s.add(f"b{i}", 4, 2, group="B")
    assert [r.rid for r in s.waiting][:4] == ["a0", "b0", "a1", "b1"]
    s2 = make(max_run=3)
    for i in range(5):
        s2.add(f"r{i}", 4, 2)                    # one group each: FCFS, every slot used
    assert s2.schedule().admitted == ("r0", "r1", "r2")


def test_no_overtaking_across_groups_when_the_head_does_not_fit():
    s = make(max_run=8, cap=100)
    s.add("big", 60, 20, group="G")
    s.schedule()
    s.add("big2", 60, 20, group="H")            # does not fit until "big" ends
    s.add("small", 4, 2, group="S")
    assert s.schedule().admitted == ()          # "small" waits behind the head (no starvation)
    s.finish("big")
    assert s.schedule().admitted == ("big2", "small")


def test_abort_of_a_large_waiting_fanout():
    """20,000 waiting siblings added and aborted one by one (by id, no scan of the queue)."""
    s = make(max_run=64)
    n = 20_000
    for i in range(n):
        s.add(f"f{i}", 8, 4, group="fan")
    s.add("solo", 8, 4)
    for i in range(n):
        assert s.finish(f"f{i}") == "waiting"
    assert [r.rid for r in s.waiting] == ["solo"] and s.num_waiting == 1
