"""Programmatic dependent launch (Hopper and later), used where it pays: the small-projection GEMV.

A kernel launched with ``launch_pdl=True`` may be scheduled before the kernel ahead of it in the
stream has finished, as soon as every program of that kernel has called
``gdc_launch_dependents`` (or exited). Until it calls ``gdc_wait`` (the kernel ahead has completed
and its writes are visible) it must touch nothing that kernel writes or reads.

The GEMV (gemv.py) loads its weights, which no kernel writes, before it waits; the kernels that
run right before a decode projection (RMSNorm, SiLU-and-mul, the attention merge) call
``allow_dependents`` first thing, so the GEMV's programs start, and fetch their weights, while
those kernels run. On an H200 this took a SmolLM2-135M decode step from 1.03 to 0.61 ms of GPU
time (results/h200-s7/). Launching every kernel this way (each waiting at entry) measured slower
instead: the Double Sparsity stages by 2-7 us per layer, the dense attention at 64K x 3 by 23 us.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def enter(PDL: tl.constexpr):
    """In a kernel launched with ``launch_pdl``: wait for the kernel ahead, then let the next start."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def allow_dependents(PDL: tl.constexpr):
    """In a kernel launched normally: let a ``launch_pdl`` kernel behind it be scheduled now."""
    if PDL:
        gdc_launch_dependents()
