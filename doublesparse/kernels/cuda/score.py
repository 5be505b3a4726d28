"""Host launcher of the CUDA C++ label score (score.cu), compiled at run time by NVRTC (nvrtc.py).

Writes the same fp16 score rows as the Triton score kernels (ds_score.py, ds_select.py) and, with
``do_hist``, also the select's first phase (hist[0] += the keys' high-byte histogram), so the
select then starts at its second phase. ``why_not`` says why a call cannot take this path (dtypes,
alignment, sizes, NVRTC); ``ds_launch`` then uses Triton. ``score`` only launches: no host syncs,
capturable.
"""

from __future__ import annotations

import torch

from . import nvrtc

NAME = "score.cu"
KERNELS = ("ds_score",)
THREADS = 256  # score.cu's THREADS
_LABEL = {torch.bfloat16: 0, torch.float16: 1, torch.float8_e4m3fn: 2}
_QTYPE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_MODE = {"per_head": 0, "group_sum": 1, "group_max": 2}
_SMEM = 48 * 1024  # static shared memory a block may use


def step_tokens(hkv: int, rows_per_thread: int) -> int:
    """Tokens a block scores per step (score.cu's STEP): slices are whole steps."""
    return (THREADS // hkv) * rows_per_thread


def _query_smem(hq: int, hkv: int, r: int) -> int:
    """Bytes of score.cu's query block: each KV head's G * r floats, padded by 4."""
    return (hq * r + 4 * hkv) * 4


def hist_fits(hq: int, hkv: int, r: int, mode: str) -> bool:
    """Whether the fused histogram's shared memory (256 ints per score row) fits a block beside
    the query block (callers pass ``do_hist`` only where it does)."""
    rows = hq if mode == "per_head" else hkv
    return rows * 1024 + _query_smem(hq, hkv, r) <= _SMEM


def _defines(q, label_cache, channels, mode, do_hist, rows_per_thread, min_blocks):
    Hq, Hkv, r = q.shape[1], label_cache.shape[1], label_cache.shape[2]
    return (("HKV", Hkv), ("G", Hq // Hkv), ("R", r), ("MODE", _MODE[mode]), ("LABEL", _LABEL[label_cache.dtype]),
            ("QTYPE", _QTYPE[q.dtype]), ("CH64", int(channels.dtype == torch.int64)), ("DO_HIST", int(do_hist)),
            ("LPT", rows_per_thread), ("MINB", min_blocks))


def why_not(q, label_cache, channels, mode, do_hist, rows_per_thread, min_blocks) -> str | None:
    """None if ``score`` can run these arguments, else why not (compiles on the first call).
    ``do_hist`` only where ``hist_fits``."""
    if q.device.type != "cuda":
        return f"device {q.device} is not a CUDA device"
    if label_cache.dtype not in _LABEL or q.dtype not in _QTYPE:
        return f"labels {label_cache.dtype} / q {q.dtype} are not supported"
    Hq, Hkv, r = q.shape[1], label_cache.shape[1], label_cache.shape[2]
    es = label_cache.element_size()
    if (r * es) % 16 or (label_cache.stride(0) * es) % 16 or (label_cache.stride(1) * es) % 16 \
            or label_cache.data_ptr() % 16:
        return "label rows are not whole 16-byte vectors"
    if Hkv > THREADS:
        return f"Hkv = {Hkv} > {THREADS} KV heads"
    if _query_smem(Hq, Hkv, r) > _SMEM:
        return "the query block does not fit shared memory"
    return nvrtc.unavailable(q.device, NAME, KERNELS,
                             _defines(q, label_cache, channels, mode, do_hist, rows_per_thread, min_blocks))


def score(q, label_cache, label_scale, channels, req_to_token, req_idx, seq_lens, scores, hist, sm_scale,
          k, threshold, num_sink, num_recent, mode, P, do_hist, rows_per_thread, min_blocks, extra=()):
    """Stage 1 (and, with ``do_hist``, the select's phase 1). Grid (B, P).

    q: [B, Hq, D]; label_cache: [slots, Hkv, r] bf16/fp16/fp8 (label_scale: [1] fp32 for fp8);
    channels: [Hkv, r] int32/int64; scores: [B, rows, L] fp16; hist: [1 + progs, B, rows, 256] int32.
    ``extra``: more (name, value) defines (score.cu's PROBE variants, for benchmarks).
    """
    B = q.shape[0]
    defines = _defines(q, label_cache, channels, mode, do_hist, rows_per_thread, min_blocks) + tuple(extra)
    kern = nvrtc.kernel(q.device, NAME, KERNELS, "ds_score", defines)
    kern(grid=(B, P, 1), block=(THREADS, 1, 1),
         args=[q, label_cache, channels, label_scale if label_scale is not None else q, req_to_token, req_idx,
               int(req_idx.dtype == torch.int64), seq_lens, scores, hist, float(sm_scale),
               *nvrtc.ints("CUDA score", k, threshold, num_sink, num_recent, q.stride(0), q.stride(1),
                           label_cache.stride(0), label_cache.stride(1), channels.stride(0),
                           req_to_token.stride(0), scores.stride(0), scores.stride(1), hist.stride(1),
                           hist.stride(2), P)])
