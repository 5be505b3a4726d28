"""Host launcher of the CUDA C++ top-k select (select.cu), compiled at run time with NVRTC.

The kernels keep ds_topk.py's workspace protocol and output, so ``ds_launch`` can run either
(``TUNING["select_impl"]``). NVRTC comes with PyTorch's CUDA builds; PyTorch reaches it through
``torch.cuda._compile_kernel``, a private helper, so ``unavailable(device)`` says why this path
cannot run (no such helper, not NVIDIA, a failed compile) and callers fall back to Triton. Like the
Triton launchers, ``hist_high``/``hist_low``/``compact`` only launch: no host syncs, capturable.
"""

from __future__ import annotations

import functools
import pathlib

import torch

SOURCE = pathlib.Path(__file__).with_name("select.cu")
THREADS = 256  # select.cu's THREADS
CHUNK = 2048  # select.cu's CHUNK: keys per block per step; slices are whole chunks
KERNELS = ("ds_select_hist_high", "ds_select_hist_low", "ds_select_compact")
_INT32_MAX = 2**31 - 1


@functools.lru_cache(maxsize=None)
def _compiled(device_index: int):
    with torch.cuda.device(device_index):
        src = SOURCE.read_text()
        return {name: torch.cuda._compile_kernel(src, name) for name in KERNELS}


@functools.lru_cache(maxsize=None)
def _unavailable(device_index: int) -> str | None:
    if torch.version.hip is not None:
        return "not an NVIDIA GPU"
    if not hasattr(torch.cuda, "_compile_kernel"):
        return f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC)"
    try:
        _compiled(device_index)
    except Exception as e:  # NVRTC missing or the compile failed: say so once, use Triton
        return f"NVRTC compile of {SOURCE.name} failed: {type(e).__name__}: {e}"
    return None


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def unavailable(device: torch.device) -> str | None:
    """None if the CUDA select can run on ``device``, else why not (compiles on first call)."""
    if device.type != "cuda":
        return f"device {device} is not a CUDA device"
    return _unavailable(_index(device))


def aligned(scores: torch.Tensor) -> bool:
    """Whether ``scores`` rows allow the kernels' 16-byte key loads (fp16, unit inner stride)."""
    return (scores.dtype == torch.float16 and scores.stride(2) == 1 and scores.data_ptr() % 16 == 0
            and scores.stride(0) % 8 == 0 and scores.stride(1) % 8 == 0)


def _ints(*xs):
    for x in xs:
        if not -_INT32_MAX <= int(x) <= _INT32_MAX:
            raise ValueError(f"CUDA select: integer argument {x} does not fit 32 bits")
    return [int(x) for x in xs]


def _kernel(name, device):
    return _compiled(_index(device))[name]


def hist_high(scores, hist, seq_lens, k, threshold, B, rows, P):
    """Phase 1: hist[0] += the high-byte histogram of each row's keys. Grid (B, rows, P)."""
    _kernel("ds_select_hist_high", scores.device)(
        grid=(B, rows, P), block=(THREADS, 1, 1),
        args=[scores, hist, seq_lens, *_ints(k, threshold, scores.stride(0), scores.stride(1),
                                              hist.stride(1), hist.stride(2), P)])


def hist_low(scores, hist, info, counts, seq_lens, k, threshold, B, rows, P):
    """Phase 2: rowinfo, hist[1 + p] and counts[p] of each row. Grid (B, rows, P)."""
    _kernel("ds_select_hist_low", scores.device)(
        grid=(B, rows, P), block=(THREADS, 1, 1),
        args=[scores, hist, info, counts, seq_lens,
              *_ints(k, threshold, scores.stride(0), scores.stride(1), hist.stride(0), hist.stride(1),
                     hist.stride(2), info.stride(0), info.stride(1), counts.stride(0), counts.stride(1), P)])


def compact(scores, hist, info, counts, seq_lens, sel, sel_slot, req_to_token, req_idx, k, threshold,
            B, rows, P):
    """Phase 3: sel / sel_slot of each row, hist[0] cleared. Grid (B, rows, P), P as phase 2's."""
    _kernel("ds_select_compact", scores.device)(
        grid=(B, rows, P), block=(THREADS, 1, 1),
        args=[scores, hist, info, counts, seq_lens, sel, sel_slot, req_to_token, req_idx,
              *_ints(req_idx.dtype == torch.int64, k, threshold, scores.stride(0), scores.stride(1),
                     hist.stride(0), hist.stride(1), hist.stride(2), info.stride(0), info.stride(1),
                     counts.stride(0), counts.stride(1), sel.stride(0), sel.stride(1),
                     req_to_token.stride(0), P)])
