"""Test-wide setup: without a GPU, Triton kernels run under the interpreter (TRITON_INTERPRET=1).

The variable must be set before any @triton.jit function is defined, i.e. before doublesparse's
kernel modules are imported, which is why it lives here at collection time.

Under pytest-xdist (the README's ``-n 2``), each worker runs with its share of the cores: two
workers of two OpenMP threads each on a 2-core box spin-wait on each other.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _worker_threads() -> int | None:
    """Intra-op threads of one xdist worker (None outside xdist): the cores split evenly."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers <= 1:
        return None
    return max(1, (os.cpu_count() or 1) // workers)


_THREADS = _worker_threads()
if _THREADS is not None:
    torch.set_num_threads(_THREADS)
    # server subprocesses started by the tests inherit it (torch reads it at import)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)


@pytest.fixture(scope="module")
def one_thread():
    """Run a module single-threaded (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    decode on CPU is many tiny ops, and on a shared 2-core box two OpenMP threads spin-wait on each
    other (measured 91 s vs 5.6 s for 32 SmolLM2 tokens). Restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
