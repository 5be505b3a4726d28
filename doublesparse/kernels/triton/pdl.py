"""Programmatic dependent launch (Hopper and later): hide the gap between back-to-back kernels.

A kernel launched with ``launch_pdl=True`` may be scheduled while the kernel ahead of it in the
stream is still draining its last programs. ``enter`` is the first thing every kernel here does:
it waits (``griddepcontrol.wait``: the previous grid has completed and its writes are visible)
before touching memory, then allows the next kernel to be scheduled. So stream order is kept
exactly; only the launch latency between kernels is overlapped. A decode step is hundreds of
small launches (about ten per layer), where that latency is a visible share of the step.
The launchers pass ``PDL`` and ``launch_pdl`` through ``launch.pdl_kwargs``.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def enter(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
