"""Run-time compilation of this package's CUDA C++ kernels (``*.cu`` beside this file) by NVRTC.

NVRTC comes with PyTorch's CUDA builds; PyTorch reaches it through ``torch.cuda._compile_kernel``,
a private helper, so ``unavailable`` says why a source cannot run (no such helper, not NVIDIA, a
failed compile) and callers fall back to their Triton kernels. A source is compiled once per
(device, set of ``#define`` values); compile-time sizes let the compiler unroll and keep arrays in
registers.
"""

from __future__ import annotations

import functools
import pathlib

import torch

HERE = pathlib.Path(__file__).parent
_INT32_MAX = 2**31 - 1


def source(name: str) -> pathlib.Path:
    return HERE / name


def _text(name: str) -> str:
    """The source with its local ``#include "x.cuh"`` lines replaced by those files (NVRTC is given
    one string; nvcc, in the tests, reads the includes itself)."""
    lines = []
    for line in source(name).read_text().splitlines(keepends=True):
        if line.startswith('#include "'):
            lines.append(_text(line.split('"')[1]))
        else:
            lines.append(line)
    return "".join(lines)


@functools.lru_cache(maxsize=None)
def _compiled(device_index: int, name: str, kernels: tuple, defines: tuple):
    text = "".join(f"#define {k} {v}\n" for k, v in defines) + _text(name)
    with torch.cuda.device(device_index):
        return {k: torch.cuda._compile_kernel(text, k) for k in kernels}


@functools.lru_cache(maxsize=None)
def _unavailable(device_index: int, name: str, kernels: tuple, defines: tuple) -> str | None:
    if torch.version.hip is not None:
        return "not an NVIDIA GPU"
    if not hasattr(torch.cuda, "_compile_kernel"):
        return f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC)"
    try:
        _compiled(device_index, name, kernels, defines)
    except Exception as e:  # NVRTC missing or the compile failed: the caller says so once
        return f"NVRTC compile of {name} failed: {type(e).__name__}: {e}"
    return None


def index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def unavailable(device: torch.device, name: str, kernels: tuple, defines: tuple = ()) -> str | None:
    """None if ``kernels`` of source ``name`` with ``defines`` ((key, value) pairs) compile for
    ``device``, else why not. Compiles on the first call."""
    if device.type != "cuda":
        return f"device {device} is not a CUDA device"
    return _unavailable(index(device), name, tuple(kernels), tuple(defines))


def kernel(device: torch.device, name: str, kernels: tuple, kernel_name: str, defines: tuple = ()):
    """The compiled ``kernel_name`` (call it with grid=, block=, args=)."""
    return _compiled(index(device), name, tuple(kernels), tuple(defines))[kernel_name]


def ints(what: str, *xs) -> list:
    """``xs`` as Python ints that fit the kernels' 32-bit int parameters."""
    for x in xs:
        if not -_INT32_MAX <= int(x) <= _INT32_MAX:
            raise ValueError(f"{what}: integer argument {x} does not fit 32 bits")
    return [int(x) for x in xs]
