"""Test-wide setup: without a GPU, Triton kernels run under the interpreter (TRITON_INTERPRET=1).

The variable must be set before any @triton.jit function is defined, i.e. before doublesparse's
kernel modules are imported, which is why it lives here at collection time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
