"""Choosing the number of CPU intra-op threads for calibration from measured sample times.

On a small shared machine the best thread count depends on what else is running. Measured on
2 cores, SmolLM2-135M, one 2048-token sample: idle machine 2 threads ~7 s, 1 thread ~12 s; with
another process busy on the cores 2 threads 20-27 s, 1 thread 12-14 s (every op's OpenMP barrier
waits for the thread that lost its core). No fixed choice is good in both cases, so calibration
times its samples and keeps the faster count, re-measuring the other one now and then because the
load changes. The statistics do not depend on this beyond float rounding.
"""

from __future__ import annotations

import contextlib

import torch


class ThreadChooser:
    """Pick a thread count per sample: try each candidate once, then use the one with the lowest
    last measured seconds per token, except that every ``recheck``-th choice re-measures the
    candidate measured longest ago (one possibly slow sample buys tracking of the load)."""

    def __init__(self, candidates: list[int], recheck: int = 5):
        self.candidates = sorted(set(int(c) for c in candidates if int(c) >= 1), reverse=True)
        if not self.candidates:
            raise ValueError(f"need at least one thread count >= 1, got {candidates}")
        self.recheck = max(2, int(recheck))
        self.cost: dict[int, float] = {}      # threads -> last seconds per token
        self.when: dict[int, int] = {}        # threads -> index of the sample that measured it
        self.chosen: list[int] = []           # thread count of every sample, in order

    def next(self) -> int:
        untried = [c for c in self.candidates if c not in self.cost]
        if untried:
            n = untried[0]
        elif len(self.candidates) > 1 and len(self.chosen) % self.recheck == self.recheck - 1:
            n = min(self.candidates, key=lambda c: self.when[c])
        else:
            n = min(self.candidates, key=lambda c: self.cost[c])
        self.chosen.append(n)
        return n

    def record(self, threads: int, seconds: float, tokens: int) -> None:
        self.cost[threads] = seconds / max(1, tokens)
        self.when[threads] = len(self.chosen) - 1


def candidates_for(cpu_threads: int, device) -> list[int]:
    """``cpu_threads`` > 0: just that; 0 (auto): torch's current count and 1 (CPU only)."""
    if cpu_threads > 0:
        return [cpu_threads]
    n = torch.get_num_threads()
    return [n, 1] if torch.device(device).type == "cpu" and n > 1 else [n]


@contextlib.contextmanager
def num_threads(n: int):
    """Run the block with ``n`` intra-op threads, then restore the previous count."""
    old = torch.get_num_threads()
    if n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)
