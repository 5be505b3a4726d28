"""Host launcher of the CUDA C++ label scores, compiled at run time by NVRTC (nvrtc.py): score.cu
(CUDA cores, any shape) and score_tc.cu (tensor cores, ``tc_fits``).

Writes the same fp16 score rows as the Triton score kernels (ds_score.py, ds_score_rows.py) and, with
``do_hist``, also the select's first phase (hist[0] += the keys' high-byte histogram), so the
select then starts at its second phase. ``why_not`` says why a call cannot take this path (dtypes,
alignment, sizes, NVRTC); ``ds_launch`` then uses Triton. ``score`` only launches: no host syncs,
capturable.
"""

from __future__ import annotations

import torch

from . import nvrtc

SOURCES = {False: ("score.cu", ("ds_score",)), True: ("score_tc.cu", ("ds_score_tc",))}  # by tc
THREADS = 256  # both sources' THREADS
_LABEL = {torch.bfloat16: 0, torch.float16: 1, torch.float8_e4m3fn: 2}
_QTYPE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_MODE = {"per_head": 0, "group_sum": 1, "group_max": 2}
_SMEM = 48 * 1024  # static shared memory a block may use


def _row_words(label_cache, hpw: int) -> int:
    """32-bit label words per lane and row of a unit of ``hpw`` KV heads (4 channels per
    16-channel piece: 2 words, 1 in fp8)."""
    return hpw * label_cache.shape[2] // 16 * (1 if label_cache.dtype == torch.float8_e4m3fn else 2)


def _heads_per_warp(q, label_cache, max_hpw: int = 8) -> int:
    """score_tc.cu's HPW: the most adjacent KV heads (up to 8 / G, G being 1, 2 or 4, and up to
    ``max_hpw``) whose query heads fill the mma's 8 columns, that divide Hkv and keep a lane's row
    within 16 words (its registers); 1 where the pool's heads are not contiguous. With G = 4 it is
    2: each lane then loads 16-byte pieces."""
    Hq, Hkv, r = q.shape[1], label_cache.shape[1], label_cache.shape[2]
    G = Hq // Hkv
    if G not in (1, 2, 4) or label_cache.stride(1) != r:
        return 1
    hpw = 8 // G
    while hpw > 1 and (hpw > max_hpw or Hkv % hpw or _row_words(label_cache, hpw) > 16):
        hpw //= 2
    return hpw


RING_WORDS = 64  # score_tc.cu's registers for label rows per lane: DEPTH * LT * 2 rows * row words


def _tc_geometry(q, label_cache, tiles: int, depth: int = 2, max_hpw: int = 8) -> tuple[int, int, int]:
    """(HPW, LT, DEPTH) of score_tc.cu: tiles per step and then the ring's depth (at least 2)
    capped so that the ring's label rows fit RING_WORDS registers per lane."""
    hpw = _heads_per_warp(q, label_cache, max_hpw)
    row = 2 * _row_words(label_cache, hpw)  # a tile's two rows
    lt = max(1, min(tiles, RING_WORDS // (depth * row)))
    return hpw, lt, max(2, min(depth, RING_WORDS // (lt * row)))


def step_tokens(q, label_cache, per_thread: int, tc: bool = False, depth: int = 2, max_hpw: int = 8) -> int:
    """Tokens a block scores per step (the sources' STEP): slices are whole steps. ``per_thread``:
    label rows per thread (score.cu) or 16-token tiles per warp (score_tc.cu, with a ring of
    ``depth`` steps and at most ``max_hpw`` KV heads per warp)."""
    hkv = label_cache.shape[1]
    if tc:
        hpw, lt, _ = _tc_geometry(q, label_cache, per_thread, depth, max_hpw)
        return (THREADS // 32 // (hkv // hpw)) * 16 * lt
    return (THREADS // hkv) * per_thread


def tc_fits(q, label_cache, max_hpw: int = 8) -> bool:
    """Whether score_tc.cu takes these shapes: labels of 16-channel pieces, at most 8 query heads
    per KV head (one mma's columns), and warps that divide evenly among the KV heads."""
    Hq, Hkv, r = q.shape[1], label_cache.shape[1], label_cache.shape[2]
    return (label_cache.dtype in _LABEL and Hq // Hkv <= 8 and r % 16 == 0
            and (THREADS // 32) % (Hkv // _heads_per_warp(q, label_cache, max_hpw)) == 0)


def _query_smem(hq: int, hkv: int, r: int) -> int:
    """Bytes of score.cu's query block: each KV head's G * r floats, padded by 4."""
    return (hq * r + 4 * hkv) * 4


def hist_fits(hq: int, hkv: int, r: int, mode: str) -> bool:
    """Whether the fused histogram's shared memory (256 ints per score row) fits a block beside
    the query block (callers pass ``do_hist`` only where it does)."""
    rows = hq if mode == "per_head" else hkv
    return rows * 1024 + _query_smem(hq, hkv, r) <= _SMEM


def _defines(q, label_cache, channels, mode, do_hist, per_thread, min_blocks, tc, depth, max_hpw):
    Hq, Hkv, r = q.shape[1], label_cache.shape[1], label_cache.shape[2]
    common = (("HKV", Hkv), ("G", Hq // Hkv), ("R", r), ("MODE", _MODE[mode]), ("LABEL", _LABEL[label_cache.dtype]),
              ("QTYPE", _QTYPE[q.dtype]), ("CH64", int(channels.dtype == torch.int64)), ("DO_HIST", int(do_hist)),
              ("MINB", min_blocks))
    if tc:
        return common + tuple(zip(("HPW", "LT", "DEPTH"), _tc_geometry(q, label_cache, per_thread, depth, max_hpw)))
    return common + (("LPT", per_thread),)


def why_not(q, label_cache, channels, mode, do_hist, per_thread, min_blocks, tc=False, depth=2,
            max_hpw=8) -> str | None:
    """None if ``score`` can run these arguments, else why not (compiles on the first call).
    ``do_hist`` only where ``hist_fits``; ``tc`` only where ``tc_fits``; ``depth`` >= 2 (score_tc.cu's
    ring of steps); ``max_hpw`` >= 1 (its KV heads per warp at most)."""
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
    if tc and (depth < 2 or max_hpw < 1):
        return f"score_tc.cu needs a ring depth >= 2 and >= 1 KV head per warp, got {depth} and {max_hpw}"
    if tc and not tc_fits(q, label_cache, max_hpw):
        return "score_tc.cu does not take these shapes"
    return nvrtc.unavailable(q.device, *SOURCES[tc],
                             _defines(q, label_cache, channels, mode, do_hist, per_thread, min_blocks, tc, depth,
                                      max_hpw))


def score(q, label_cache, label_scale, channels, req_to_token, req_idx, seq_lens, scores, hist, sm_scale,
          k, num_sink, num_recent, mode, P, do_hist, per_thread, min_blocks, tc=False, depth=2, max_hpw=8):
    """Stage 1 (and, with ``do_hist``, the select's phase 1). Grid (B, P); score_tc.cu with ``tc``.

    q: [B, Hq, D]; label_cache: [slots, Hkv, r] bf16/fp16/fp8 (label_scale: [1] fp32 for fp8);
    channels: [Hkv, r] int32/int64; scores: [B, rows, L] fp16; hist: [1 + progs, B, rows, 256] int32;
    k: [B] int32, each request's budget (scores are written for requests with seq_len > it).
    """
    B = q.shape[0]
    defines = _defines(q, label_cache, channels, mode, do_hist, per_thread, min_blocks, tc, depth, max_hpw)
    name, kernels = SOURCES[tc]
    kern = nvrtc.kernel(q.device, name, kernels, kernels[0], defines)
    kern(grid=(B, P, 1), block=(THREADS, 1, 1),
         args=[q, label_cache, channels, label_scale if label_scale is not None else q, req_to_token, req_idx,
               int(req_idx.dtype == torch.int64), seq_lens, scores, hist, float(sm_scale), k,
               *nvrtc.ints("CUDA score", num_sink, num_recent, q.stride(0), q.stride(1),
                           label_cache.stride(0), label_cache.stride(1), channels.stride(0),
                           req_to_token.stride(0), scores.stride(0), scores.stride(1), hist.stride(1),
                           hist.stride(2), P)])
