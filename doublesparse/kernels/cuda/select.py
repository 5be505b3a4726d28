"""Host launcher of the CUDA C++ top-k select (select.cu), compiled at run time by NVRTC (nvrtc.py).

The kernels keep ds_select.py's workspace protocol and output, so ``ds_launch`` can run either
(``KernelTuning.select_impl``); ``unavailable(device)`` says why this path cannot run, and callers
fall back to Triton. Like the Triton launchers, ``hist_high``/``hist_low``/``compact`` only launch:
no host syncs, capturable.
"""

from __future__ import annotations

import torch

from . import nvrtc

NAME = "select.cu"
THREADS = 256  # select.cu's THREADS
CHUNK = 2048  # select.cu's CHUNK: keys per block per step; slices are whole chunks
KERNELS = ("ds_select_hist_high", "ds_select_hist_low", "ds_select_compact")


def unavailable(device: torch.device) -> str | None:
    """None if the CUDA select can run on ``device``, else why not (compiles on first call)."""
    return nvrtc.unavailable(device, NAME, KERNELS)


def aligned(scores: torch.Tensor) -> bool:
    """Whether ``scores`` rows allow the kernels' 16-byte key loads (fp16, unit inner stride)."""
    return (scores.dtype == torch.float16 and scores.stride(2) == 1 and scores.data_ptr() % 16 == 0
            and scores.stride(0) % 8 == 0 and scores.stride(1) % 8 == 0)


def _ints(*xs):
    return nvrtc.ints("CUDA select", *xs)


def _kernel(name, device):
    return nvrtc.kernel(device, NAME, KERNELS, name)


# k: [B] int32 on the device, each request's budget: it decodes sparsely iff
# seq_lens[b] > k[b] (else its rows select nothing), and its rows select
# min(k[b], k_max) positions (k_max: the host's bound, at most sel's row length).

def hist_high(scores, hist, seq_lens, k, B, rows, P):
    """Phase 1: hist[0] += the high-byte histogram of each row's keys. Grid (B, rows, P)."""
    _kernel("ds_select_hist_high", scores.device)(
        grid=(B, rows, P), block=(THREADS, 1, 1),
        args=[scores, hist, seq_lens, k, *_ints(scores.stride(0), scores.stride(1),
                                                        hist.stride(1), hist.stride(2), P)])


def hist_low(scores, hist, info, counts, seq_lens, k, k_max, B, rows, P):
    """Phase 2: rowinfo, hist[1 + p] and counts[p] of each row. Grid (B, rows, P)."""
    _kernel("ds_select_hist_low", scores.device)(
        grid=(B, rows, P), block=(THREADS, 1, 1),
        args=[scores, hist, info, counts, seq_lens, k,
              *_ints(k_max, scores.stride(0), scores.stride(1), hist.stride(0), hist.stride(1),
                     hist.stride(2), info.stride(0), info.stride(1), counts.stride(0), counts.stride(1), P)])


def compact(scores, hist, info, counts, seq_lens, sel, sel_slot, req_to_token, req_idx, k, k_max,
            B, rows, P):
    """Phase 3: sel / sel_slot of each row, hist[0] cleared. Grid (B, rows, P), P as phase 2's."""
    _kernel("ds_select_compact", scores.device)(
        grid=(B, rows, P), block=(THREADS, 1, 1),
        args=[scores, hist, info, counts, seq_lens, sel, sel_slot, req_to_token, req_idx, k,
              *_ints(req_idx.dtype == torch.int64, k_max, scores.stride(0), scores.stride(1),
                     hist.stride(0), hist.stride(1), hist.stride(2), info.stride(0), info.stride(1),
                     counts.stride(0), counts.stride(1), sel.stride(0), sel.stride(1),
                     req_to_token.stride(0), P)])
