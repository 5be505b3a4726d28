import ast
from pathlib import Path

import pytest

from doublesparse.config import SchedulerConfig
from doublesparse.engine.scheduler import RequestRefused, Scheduler


def make(cap=1000, ctx=512, chunk=64, max_run=8):
    return Scheduler(SchedulerConfig(max_running_requests=max_run, chunked_prefill_size=chunk), cap, ctx)


def test_no_torch_import():
    src = Path(__file__).resolve().parents[1] / "doublesparse" / "engine" / "scheduler.py"
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
    assert isinstance(RequestRefused("m"), ValueError)
    assert not s.has_unfinished()


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
