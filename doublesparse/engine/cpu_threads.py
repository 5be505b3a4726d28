"""The intra-op thread count of CPU prefill and decode steps.

On an idle machine all cores help a step's large matmuls. When another process holds a core,
every op's OpenMP barrier can wait a whole time slice for the thread that lost its core, and the
same step takes far longer on all threads than on one (2 shared cores, SmolLM2: a short prompt's
prefill ~10x, decode 1.4-4.1x). Timing steps alone did not avoid that: prefill was never timed,
and every probe of the slow choice costs seconds. So the runner first asks the cores:

* :class:`CoreLoad` reads, between steps, how much CPU time other processes took on the cores
  this process may run on (``/proc/stat`` for the CPUs of ``sched_getaffinity``, less this
  process's own time from ``/proc/self/stat``; steal time counts as taken), over the last
  :data:`WINDOW_S` or more (the engine's first step waits, once, until :data:`FIRST_WINDOW_S`
  has been measured: ``generate`` starts stepping right after the load). A core counts as taken when others used more than
  :data:`TAKEN_FRACTION` of one, and as free again below :data:`FREED_FRACTION`. A cgroup CPU
  quota (``cpu.max``) caps the cores too.
* Steps use at most the cores left (at least one): prefill all of them; a decode batch smaller
  than that keeps the faster of one thread and all of them by measured step time
  (:class:`ThreadChooser`, whose averages restart when the cores left change, since they were
  measured under another load).

Without ``/proc`` (not Linux) only the timing applies. ``cpu_threads`` set (``--cpu-threads N``)
fixes the count of every step instead.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, NamedTuple

ALPHA = 0.3          # weight of a new step time in the moving average
WARMUP = 2           # steps each choice runs before the comparison starts
PROBE_EVERY = 32     # steps between tries of the losing choice, doubled on every loss ...
PROBE_MAX = 2048     # ... up to this
WINDOW_S = 0.25      # shortest interval the cores' load is measured over (/proc/stat ticks: 10 ms)
FIRST_WINDOW_S = 0.1  # the first step waits until this long has been measured (once per engine)
TAKEN_FRACTION = 0.25  # others' use of a core above which it counts as taken ...
FREED_FRACTION = 0.1   # ... and below which it counts as free again (no flapping in between)


class CpuSample(NamedTuple):
    t: float          # seconds (monotonic)
    busy: float       # CPU seconds spent on the allowed CPUs by everything (not idle / iowait)
    own: float        # CPU seconds of this process


def read_proc_sample(cpus: frozenset[int] | None = None, clock=time.monotonic) -> CpuSample | None:
    """``/proc/stat`` and ``/proc/self/stat`` now; None where they cannot be read."""
    try:
        hz = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        with open("/proc/self/stat") as f:
            own_fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    busy = 0
    for ln in lines:
        if not ln.startswith("cpu") or ln[3:4] == " ":
            continue
        name, *v = ln.split()
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal (guest time is inside user/nice)
        busy += sum(int(x) for i, x in enumerate(v[:8]) if i not in (3, 4))
    own = int(own_fields[11]) + int(own_fields[12])    # utime, stime (fields 14 and 15)
    return CpuSample(clock(), busy / hz, own / hz)


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time the cgroup quota allows (v2 ``cpu.max``, v1 cfs files); None: none."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


class CoreLoad:
    """How many of this process's cores other processes leave free. ``sample``: a callable
    returning a :class:`CpuSample` or None (tests pass their own)."""

    def __init__(self, sample: Callable[[], CpuSample | None] | None = None,
                 limit: float | None = None, clock=time.monotonic, sleep=time.sleep):
        if sample is None:
            cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
            sample = lambda: read_proc_sample(cpus, clock)  # noqa: E731
            limit = cgroup_cpu_limit() if limit is None else limit
        self._sample, self.clock, self._sleep = sample, clock, sleep
        self._measured = False         # an interval has been measured
        self.limit = limit
        self._prev = sample()          # from construction on: the first step sees the load
        self.others = 0.0              # cores' worth of CPU others used in the last interval
        self.taken = 0                 # cores counted as taken

    @property
    def measured(self) -> bool:
        """Whether ``others`` comes from a measured interval (False without ``/proc``)."""
        return self._measured

    def free_cores(self, max_threads: int) -> int:
        """Threads a step may use: ``max_threads`` less the cores others took (at least 1)."""
        cap = max_threads
        if self.limit is not None:
            cap = min(cap, max(1, math.floor(self.limit + 1e-9)))
        if self._prev is not None and not self._measured:
            self._sleep(max(0.0, FIRST_WINDOW_S - (self.clock() - self._prev.t)))
        if self._prev is not None and (not self._measured
                                       or self.clock() - self._prev.t >= WINDOW_S):
            now = self._sample()
            if now is not None:
                dt = now.t - self._prev.t
                if dt > 0:
                    self.others = max(0.0, (now.busy - self._prev.busy) - (now.own - self._prev.own)) / dt
                    self._measured = True
                self._prev = now
        surely = max(0, math.ceil(self.others - TAKEN_FRACTION))
        maybe = max(0, math.ceil(self.others - FREED_FRACTION))
        self.taken = min(max(self.taken, surely), maybe)
        return max(1, min(cap, max_threads - self.taken))


class ThreadChooser:
    """``pick(batch_size, max_threads)`` before a CPU decode step, ``record(threads, seconds)``
    after it: one thread or ``max_threads``, the faster by a moving average of step times."""

    def __init__(self):
        self.avg: dict[int, float] = {}
        self.count: dict[int, int] = {}
        self.best = 1
        self.every = PROBE_EVERY
        self.since_probe = 0
        self.probing: int | None = None
        self.chose = False   # the last pick was a choice (a small batch): its time is recorded
        self._max = 0        # the max_threads the averages were measured with

    def pick(self, batch_size: int, max_threads: int) -> int:
        if max_threads != self._max:   # the times were measured under another load: start again
            self.avg.clear()
            self.count.clear()
            self.best, self._max, self.since_probe = 1, max_threads, 0
        self.chose = not (max_threads <= 1 or batch_size >= max_threads)
        if not self.chose:
            return max(1, min(max_threads, batch_size))
        for c in (1, max_threads):
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


class CpuThreads:
    """The runner's thread policy: ``prefill(max_threads)`` / ``decode(batch, max_threads)``
    give a step's count, ``record(threads, seconds)`` takes a decode step's time. ``fixed``: that
    count for every step. ``load``: a :class:`CoreLoad` (default: this machine's)."""

    def __init__(self, fixed: int | None = None, load: CoreLoad | None = None):
        self.fixed = fixed
        self.load = load if load is not None or fixed is not None else CoreLoad()
        self.chooser = ThreadChooser()

    def prefill(self, max_threads: int) -> int:
        if self.fixed is not None:
            return self.fixed
        return self.load.free_cores(max_threads)

    def decode(self, batch_size: int, max_threads: int) -> int:
        if self.fixed is not None:
            self.chooser.chose = False
            return self.fixed
        return self.chooser.pick(batch_size, self.load.free_cores(max_threads))

    def record(self, threads: int, seconds: float) -> None:
        self.chooser.record(threads, seconds)
