"""Programmatic dependent launch (Hopper and later) for the small kernels of a decode step.

A kernel launched with ``launch_pdl=True`` may be scheduled before the kernel ahead of it in the
stream has finished, as soon as every program of that kernel has called
``gdc_launch_dependents`` (or exited). Until it calls ``gdc_wait`` (the kernel ahead has completed
and its writes are visible) it must touch nothing that kernel writes or reads.

Taking part: RMSNorm, SiLU-and-mul, RoPE + store and the attention merge, which wait first thing
(``enter``) and so only hide their launch latency, and the small-projection GEMV (gemv.py), which
loads its weights, written by no kernel, before it waits. The attention and Double Sparsity
kernels launch normally: launched this way too, the DS stages measured 2-7 us per layer slower on
an H200 and the dense attention no faster.
"""

import triton
import triton.language as tl
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except ImportError:  # Triton before 3.4: no PDL (common.pdl_enabled is then False)
    gdc_launch_dependents = gdc_wait = None
    HAVE_GDC = False


@triton.jit
def enter(PDL: tl.constexpr):
    """In a kernel launched with ``launch_pdl``: wait for the kernel ahead, then let the next start."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
