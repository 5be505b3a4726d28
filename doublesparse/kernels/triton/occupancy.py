"""How many programs of a compiled Triton kernel one SM holds at once (the CUDA occupancy API).

A kernel whose programs wait for one another (ds_topk's row barrier) deadlocks unless every
program it waits for is resident; its launcher sizes the grid from this number. Any failure
(no libcuda, an unexpected Triton object) answers 0, which callers read as "do not rely on
co-residency".
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def resident_per_sm(kernel, *args, **kwargs) -> int:
    """Programs of ``kernel`` (a @triton.jit function) compiled for ``args``/``kwargs`` (the launch's
    arguments and constexprs) that fit on one SM together; compiles the kernel, launches nothing."""
    try:
        compiled = kernel.warmup(*args, grid=(1,), **kwargs)
        compiled._init_handles()
        threads = 32 * compiled.metadata.num_warps
        n = ctypes.c_int(0)
        rc = _libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(n), ctypes.c_void_p(compiled.function), ctypes.c_int(threads),
            ctypes.c_size_t(compiled.metadata.shared))
        if rc != 0:
            log.warning("cuOccupancyMaxActiveBlocksPerMultiprocessor failed (CUresult %d)", rc)
            return 0
        return int(n.value)
    except Exception as e:  # noqa: BLE001 - any failure only turns the optimisation off
        log.warning("occupancy query failed (%s): %s", type(e).__name__, e)
        return 0
