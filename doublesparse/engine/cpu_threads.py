"""The intra-op thread count of CPU decode steps, chosen by timing them.

A decode step of a small batch is hundreds of small ops plus a few large matmuls. On an idle
machine all cores help the matmuls; when another process holds a core, every op's OpenMP
barrier can wait a whole time slice and the same step takes far longer on all threads than on
one. Neither choice is
right everywhere, so the runner times its steps: it tries each candidate (one thread, and
torch's thread count) twice, keeps the faster by a moving average, and tries the other again
from time to time, backing off while it keeps losing so that a loaded machine pays for few slow
probes. Batches of at least as many requests as threads always use them all (as before).
"""

from __future__ import annotations

ALPHA = 0.3          # weight of a new step time in the moving average
WARMUP = 2           # steps each choice runs before the comparison starts
PROBE_EVERY = 32     # steps between tries of the losing choice, doubled on every loss ...
PROBE_MAX = 2048     # ... up to this


class ThreadChooser:
    """``pick(batch_size, max_threads)`` before a CPU decode step, ``record(threads, seconds)``
    after it."""

    def __init__(self):
        self.avg: dict[int, float] = {}
        self.count: dict[int, int] = {}
        self.best = 1
        self.every = PROBE_EVERY
        self.since_probe = 0
        self.probing: int | None = None
        self.chose = False   # the last pick was a choice (a small batch): its time is recorded

    def pick(self, batch_size: int, max_threads: int) -> int:
        self.chose = not (max_threads <= 1 or batch_size >= max_threads)
        if not self.chose:
            return max(1, min(max_threads, batch_size))
        choices = (1, max_threads)
        for c in choices:
            if self.count.get(c, 0) < WARMUP:
                self.probing = c
                return c
        self.since_probe += 1
        if self.since_probe >= self.every:
            self.since_probe = 0
            self.probing = max_threads if self.best == 1 else 1
            return self.probing
        self.probing = None
        return self.best

    def record(self, threads: int, seconds: float) -> None:
        if not self.chose:  # a large batch's step says nothing about the small batches' choice
            return
        old = self.avg.get(threads)
        self.avg[threads] = seconds if old is None else (1 - ALPHA) * old + ALPHA * seconds
        self.count[threads] = self.count.get(threads, 0) + 1
        if len(self.avg) < 2 or min(self.count.values()) < WARMUP:
            return
        best = min(self.avg, key=self.avg.get)
        if self.probing is not None and self.probing != best:
            self.every = min(2 * self.every, PROBE_MAX)   # the probe lost: try it less often
        elif self.probing is not None:
            self.every = PROBE_EVERY
        self.best = best
        self.probing = None
