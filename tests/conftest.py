"""Test-wide setup: without a GPU, Triton kernels run under the interpreter (TRITON_INTERPRET=1).

The variable must be set before any @triton.jit function is defined, i.e. before doublesparse's
kernel modules are imported, which is why it lives here at collection time.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def one_thread():
    """Run a module single-threaded (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    decode on CPU is many tiny ops, and on a shared 2-core box two OpenMP threads spin-wait on each
    other (measured 91 s vs 5.6 s for 32 SmolLM2 tokens). Restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
