"""The server's C heap: the fixed mmap threshold keeps freed large blocks out of the heap."""

import subprocess
import sys

import pytest

from doublesparse.server.host_heap import malloc_info

pytestmark = pytest.mark.skipif(malloc_info() is None, reason="not glibc >= 2.33")

# A block freed once raises glibc's threshold; the next large ones then stay in the heap when freed.
_PROBE = """
import ctypes, json, sys
from doublesparse.server.host_heap import fix_mmap_threshold, malloc_info
fixed = fix_mmap_threshold() if sys.argv[1] == "fixed" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(4 << 20))                        # raises the dynamic threshold (glibc default)
blocks, pins = [], []
for _ in range(64):                                    # 64 MiB of 1 MiB blocks, each followed by a
    blocks.append(libc.malloc(1 << 20))                # small one that lives on (as a server's
    pins.append(libc.malloc(32 << 10))                 # request objects do): holes, not a top
for b in blocks:
    libc.free(b)
print(json.dumps({"fixed": fixed, **malloc_info()}))
"""


def _heap(mode: str) -> dict:
    import json
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_fixed_threshold_returns_large_blocks():
    default, fixed = _heap("default"), _heap("fixed")
    assert fixed["fixed"] is True
    assert default["free"] >= 32 << 20           # glibc's default kept most of the 64 MiB
    assert fixed["free"] < 8 << 20               # fixed: each block went back on free
