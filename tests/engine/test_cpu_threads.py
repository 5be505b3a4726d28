"""The thread count of CPU steps (engine/cpu_threads.py): the cores other processes leave free,
and for small decode batches the faster of one thread and those by measured step time."""

import os
import time

import pytest

from doublesparse.engine.cpu_threads import (FIRST_WINDOW_S, PROBE_EVERY, CoreLoad, CpuSample, CpuThreads,
                                             ThreadChooser, read_proc_sample)


def _run(step_s: dict, steps: int = 300) -> tuple[list[int], ThreadChooser]:
    c, seq = ThreadChooser(), []
    for _ in range(steps):
        n = c.pick(1, 2)
        seq.append(n)
        c.record(n, step_s[n])
    return seq, c


def test_keeps_the_faster_choice_and_backs_off_probing_the_other():
    seq, c = _run({1: 0.089, 2: 0.063})          # an idle machine: both threads pay
    assert seq[:4] == [1, 1, 2, 2] and c.best == 2
    assert seq[4:].count(1) <= 3 and c.every > PROBE_EVERY
    seq, c = _run({1: 0.17, 2: 2.4})             # a loaded one: barrier waits on 2 threads
    assert c.best == 1 and seq[4:].count(2) <= 3


def test_follows_a_change_and_large_batches_use_every_thread():
    c = ThreadChooser()
    for i in range(400):
        n = c.pick(1, 2)
        c.record(n, (0.063 if n == 2 else 0.089) if i < 100 else (2.4 if n == 2 else 0.17))
    assert c.best == 1
    assert c.pick(2, 2) == 2 and c.pick(5, 4) == 4 and c.pick(1, 1) == 1


class FakeCores:
    """A machine of ``n`` cores where ``others`` cores' worth of CPU goes to other processes and
    this process uses ``own``; the clock advances by hand."""

    def __init__(self, others: float = 0.0, own: float = 1.0):
        self.t, self.busy, self.own_s, self.others, self.own = 0.0, 0.0, 0.0, others, own

    def advance(self, dt: float) -> None:
        self.t += dt
        self.busy += (self.others + self.own) * dt
        self.own_s += self.own * dt

    def sample(self) -> CpuSample:
        return CpuSample(self.t, self.busy, self.own_s)


def _load(cores: FakeCores, limit=None) -> CoreLoad:
    return CoreLoad(cores.sample, limit=limit, clock=lambda: cores.t, sleep=cores.advance)


def test_the_first_step_waits_for_a_first_measurement():
    cores = FakeCores(others=1.0)
    load = _load(cores)
    assert load.free_cores(2) == 1 and cores.t == pytest.approx(FIRST_WINDOW_S)
    cores.advance(0.01)
    assert load.free_cores(2) == 1 and cores.t == pytest.approx(FIRST_WINDOW_S + 0.01)


def test_cores_taken_by_other_processes_are_left_to_them():
    cores = FakeCores(others=0.0)
    load = _load(cores)
    cores.advance(1.0)
    assert load.free_cores(2) == 2
    cores.others = 0.9                           # a competing process on one core
    cores.advance(0.1)
    assert load.free_cores(2) == 2               # inside the window: the last estimate
    cores.advance(0.2)
    assert load.free_cores(2) == 1 and load.free_cores(16) == 15
    cores.others = 0.3                           # a third of a core is enough to count
    cores.advance(0.5)
    assert load.free_cores(2) == 1
    cores.others = 0.2                           # between the thresholds: no change ...
    cores.advance(0.5)
    assert load.free_cores(2) == 1
    cores.others = 0.05                          # ... background noise is free
    cores.advance(0.5)
    assert load.free_cores(2) == 2
    cores.others = 0.2
    cores.advance(0.5)
    assert load.free_cores(2) == 2
    cores.others = 5.0
    cores.advance(0.5)
    assert load.free_cores(2) == 1               # never fewer than one
    assert _load(FakeCores(), limit=1.5).free_cores(8) == 1      # a cgroup quota of 1.5 CPUs


def test_policy_prefill_uses_the_free_cores_and_decode_times_within_them():
    cores = FakeCores(others=0.0)
    pol = CpuThreads(load=_load(cores))
    cores.advance(1.0)
    assert pol.prefill(2) == 2
    seq = []
    for _ in range(6):                           # idle: 1 and 2 threads timed, 2 wins
        n = pol.decode(1, 2)
        seq.append(n)
        pol.record(n, 0.06 if n == 2 else 0.09)
        cores.advance(0.05)
    assert seq[:4] == [1, 1, 2, 2] and seq[4:] == [2, 2]
    cores.others = 1.0                           # a competitor arrives: no probe of 2 threads
    cores.advance(0.3)
    assert pol.prefill(2) == 1
    assert all(pol.decode(1, 2) == 1 for _ in range(100))
    cores.others = 0.0                           # it leaves: timing starts again from scratch
    cores.advance(0.3)
    assert pol.decode(1, 2) == 1 and pol.chooser.count == {}
    fixed = CpuThreads(fixed=1)
    assert fixed.prefill(8) == 1 and fixed.decode(1, 8) == 1 and fixed.decode(16, 8) == 1


def test_proc_readings_are_sane_where_there_is_proc():
    s = read_proc_sample()
    if s is None:
        pytest.skip("no /proc on this platform")
    assert s.busy > 0 and 0 < s.own
    load = CoreLoad()
    x = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.3:          # this process's own work is not "others"
        x += 1
    n = os.cpu_count() or 1
    assert 1 <= load.free_cores(n) <= n and load.others >= 0 and load.measured
