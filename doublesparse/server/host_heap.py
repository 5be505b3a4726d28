"""The server process's C heap (glibc): what it holds, and a fixed mmap threshold.

glibc serves an allocation of 128 KiB or more with its own mmap, returned to the system on free,
until such a block is freed: then it raises that threshold (up to 32 MiB) and serves the next
ones from the heap, where freed memory stays with the process. A server allocates host buffers of
every size from a few KB to hundreds of MB (prompts of 20K ids, prefill chunks, detokenization,
JSON bodies), and under a mixed load the heap's free-but-kept part can grow for minutes. The server
fixes the threshold at startup (tests/server/test_host_heap.py: 64 freed 1 MiB blocks between live
ones stay in the heap by default, and go back to the system with the threshold fixed).
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3   # glibc's mallopt parameter numbers (malloc.h)
MMAP_THRESHOLD = 128 * 1024


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Serve allocations of ``nbytes`` or more with mmap for the life of the process (setting it
    also turns off glibc's raising of the threshold). False where the C library is not glibc."""
    libc = _libc()
    fn = getattr(libc, "mallopt", None) if libc is not None else None
    if fn is None or not hasattr(libc, "mallinfo2"):  # mallinfo2: glibc >= 2.33; others differ
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    return fn(M_MMAP_THRESHOLD, int(nbytes)) == 1


def malloc_info() -> dict | None:
    """glibc's heap: bytes in use, free inside the heap (kept by the process) and in mmapped
    blocks; None where the C library is not glibc >= 2.33."""
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return None
    fn.restype = _Mallinfo2
    m = fn()
    return {"in_use": m.uordblks, "free": m.fordblks, "mmapped": m.hblkhd}
