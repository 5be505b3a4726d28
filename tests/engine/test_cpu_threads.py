"""The thread count of CPU decode steps, chosen by timing them (engine/cpu_threads.py)."""

from doublesparse.engine.cpu_threads import PROBE_EVERY, ThreadChooser


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
