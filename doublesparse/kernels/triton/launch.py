"""Host launchers for the Triton kernels: argument checks, launch geometry, no host syncs.

Every check here reads only shapes, dtypes, strides and devices (never tensor values), so the
launchers stay capturable in CUDA graphs. Launch geometry depends only on static sizes (batch,
heads, the workspace's max context, k), never on seq_lens.
"""

from __future__ import annotations

import functools
import json
import os

import torch
import triton

from ..workspace import DecodeWorkspace
from .decode_attn import decode_attn_kernel, merge_kernel
from .pdl import HAVE_GDC
from .rope import rope_kernel
from .store import store_kv_kernel

_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
_LABEL = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
_INDEX = (torch.int32, torch.int64)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _fail(msg: str):
    raise ValueError(msg)


def _check(t, name, ndim=None, dtypes=None, device=None, last_contig=True):
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        _fail(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        _fail(f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}")
    if device is not None and t.device != device:
        _fail(f"{name} is on {t.device}, expected {device}")
    if last_contig and t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        _fail(f"{name} must be contiguous in its last dim (stride {t.stride()})")


def _check_caches(k_cache, v_cache, dev):
    _check(k_cache, "k_cache", 3, _FLOAT, dev)
    _check(v_cache, "v_cache", 3, (k_cache.dtype,), dev)
    if v_cache.shape != k_cache.shape:
        _fail(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")


def _check_labels(label_cache, label_scale, channels, k_cache, dev):
    S, Hkv, D = k_cache.shape
    _check(label_cache, "label_cache", 3, _LABEL, dev)
    if label_cache.shape[:2] != (S, Hkv):
        _fail(f"label_cache must be [{S}, {Hkv}, r], got {tuple(label_cache.shape)}")
    r = label_cache.shape[2]
    if not 1 <= r <= D:
        _fail(f"heavy channel count r={r} must be in [1, head_dim={D}]")
    _check(channels, "channels", 2, _INDEX, dev)
    if tuple(channels.shape) != (Hkv, r):
        _fail(f"channels must be [{Hkv}, {r}] (Hkv, r), got {tuple(channels.shape)}")
    if label_cache.dtype == torch.float8_e4m3fn:
        if label_scale is None:
            _fail("fp8 labels need label_scale ([1] float32)")
        _check(label_scale, "label_scale", 1, (torch.float32,), dev)
    return r


def check_store_args(k_cache, v_cache, k, v, slots, label_cache, label_scale, channels):
    dev = k.device
    _check_caches(k_cache, v_cache, dev)
    _check(k, "k", 3, _FLOAT, dev)
    _check(v, "v", 3, _FLOAT, dev)
    N, Hkv, D = k.shape
    if tuple(v.shape) != (N, Hkv, D):
        _fail(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    if tuple(k_cache.shape[1:]) != (Hkv, D):
        _fail(f"k is [N, {Hkv}, {D}] but k_cache is {tuple(k_cache.shape)}")
    _check(slots, "slots", 1, _INDEX, dev)
    if slots.shape[0] != N:
        _fail(f"slots has {slots.shape[0]} entries for {N} tokens")
    if label_cache is not None:
        _check_labels(label_cache, label_scale, channels, k_cache, dev)


def store_kv(k_cache, v_cache, k, v, slots, label_cache=None, label_scale=None, channels=None):
    check_store_args(k_cache, v_cache, k, v, slots, label_cache, label_scale, channels)
    N, Hkv, D = k.shape
    if N == 0:
        return
    has_label = label_cache is not None
    lab = label_cache if has_label else k_cache
    ch = channels if has_label else slots
    r = label_cache.shape[2] if has_label else 1
    scale = label_scale if (has_label and label_scale is not None) else k_cache
    BLOCK_T = 16
    store_kv_kernel[(triton.cdiv(N, BLOCK_T), Hkv)](
        k, v, slots, k_cache, v_cache, lab, ch, scale, N,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        lab.stride(0), lab.stride(1), ch.stride(0),
        D=D, R=r, BLOCK_T=BLOCK_T, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_R=triton.next_power_of_2(r), HAS_LABEL=has_label,
        LABEL_FP8=has_label and label_cache.dtype == torch.float8_e4m3fn, num_warps=4,
    )


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: few programs keep CPU tests fast


def _check_decode(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, ws, out):
    dev = q.device
    _check(q, "q", 3, _FLOAT, dev)
    _check_caches(k_cache, v_cache, dev)
    B, Hq, D = q.shape
    S, Hkv, Dk = k_cache.shape
    if Dk != D:
        _fail(f"q head_dim {D} != cache head_dim {Dk}")
    if Hq % Hkv:
        _fail(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    _check(req_to_token, "req_to_token", 2, (torch.int32,), dev)
    _check(req_idx, "req_idx", 1, _INDEX, dev)
    _check(seq_lens, "seq_lens", 1, (torch.int32,), dev)
    if req_idx.shape[0] != B or seq_lens.shape[0] != B:
        _fail(f"req_idx {tuple(req_idx.shape)} and seq_lens {tuple(seq_lens.shape)} must be [{B}]")
    if not isinstance(ws, DecodeWorkspace):
        _fail("ws must be a DecodeWorkspace (allocate one at the largest batch/context)")
    if (ws.num_q_heads, ws.num_kv_heads, ws.head_dim) != (Hq, Hkv, D):
        _fail(f"workspace is for heads {ws.num_q_heads}/{ws.num_kv_heads} d{ws.head_dim}, "
              f"got {Hq}/{Hkv} d{D}")
    if B > ws.max_batch:
        _fail(f"batch {B} exceeds workspace max_batch {ws.max_batch}")
    if ws.part_o.device != dev:
        _fail(f"workspace is on {ws.part_o.device}, q on {dev}")
    if out is not None:
        _check(out, "out", 3, (q.dtype,), dev)
        if out.shape != q.shape:
            _fail(f"out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
    return B, Hq, Hkv, D


# Launch parameters, tuned on an H200 by doublesparse.bench.attention --sweep (results/).
TUNING = {
    "attn_block_n": 64, "attn_block_n_many_rows": 128, "attn_warps": 4, "attn_stages": 2, "attn_programs_per_sm": 4,
    "score_block_n": 256, "score_programs_per_sm": 8, "score_warps": 4, "score_stages": 3, "select_block_n": 1024, "select_warps": 4,
    "select_programs_per_sm": 4, "select_stages": 3, "select_atomic_hist": True, "score_hist": False,
    # The select's phases 2 and 3 (ds_topk.py) share the select_* geometry above (at most
    # workspace.SELECT_MAX_PROGS programs per row); phase 3's loop has its own pipelining depth.
    "compact_loop_stages": 1,
    # The select phases ("2", "3") that load each block's keys one iteration ahead, the first
    # before their prologue; true = "23", false or "" = none. Measured on an H200 (results/h200-s13):
    # "23" saved 0.08 ms per DS decode step at 16 x 32K, 3-6 us per layer at one part.
    "select_prefetch": "23",
    # Software-pipeline depth of the score / select loops (tl.range num_stages; 1 = no pipelining).
    "score_loop_stages": 3, "select_loop_stages": 1,
    # The select's first phase (high-byte histogram, ds_topk.py) has its own geometry.
    "hist_block_n": 4096, "hist_programs_per_sm": 8,
    # The attention over the selected tokens (the dense kernel's knobs otherwise).
    "sparse_attn_programs_per_sm": 4, "sparse_attn_stages": 2,
    # The select's kernels: "triton" (ds_topk.py), "cuda" (kernels/cuda/select.cu through NVRTC;
    # the same output), or "auto" = "cuda" where NVRTC and the GPU allow, else "triton". Measured
    # on an H200 (results/h200-s15): the DS decode step at 16 x 32K 8.48 -> 7.99 ms with "cuda".
    "select_impl": "auto",
    # Merge the split-K partials in the attention kernel's last split instead of a merge launch.
    "fuse_merge": False,
    # Scoring: "mma" = all KV heads per program, one tensor-core product (ds_score.py);
    # "rows" = one KV head per program (ds_select.score_kernel); "auto" = mma while Hkv * r <= 256
    # (its product is block-diagonal over KV heads, so its waste grows with Hkv). Measured on an
    # H200: Llama-3.1-8B (8 x 16) mma 20.6 vs rows 26.9 us per layer at 64K x 3; LongChat-7B
    # (32 x 16) rows 6.78 vs mma 7.60 ms per decode step at 20K x 3 (results/).
    # "cuda" = kernels/cuda/score.cu through NVRTC, which also makes the select's first phase
    # (score_cuda_hist); "auto" takes it in mma's place (Hkv * r <= mma_max_channels) where it can
    # run (NVIDIA GPU, bf16/fp16/fp8 labels whose rows are whole 16-byte vectors), else mma/rows as
    # above (LongChat-7B's rows score was faster than it). Measured on an H200 against mma
    # (results/h200-s16): whole DS call in graphs 3 x 64K 56.1 vs 56.8, 3 x 128K 90.7 vs 93.7,
    # 16 x 32K (two parts) 111.4 vs 114.0 us; DS decode step at 60K x 3 6.00 vs 6.11 ms.
    # "auto" also takes the CUDA score wherever its tensor-core kernel fits (score_cuda_tc below),
    # LongChat-7B included: DS attention 62.7 vs 63.5 us per layer with rows (results/h200-s17).
    "score_impl": "auto", "mma_max_channels": 256,
    "mma_block_n": 64, "mma_programs_per_sm": 4, "mma_warps": 4,
    # The CUDA score's geometry: programs per SM, label rows in flight per thread, and the blocks
    # per SM its registers must allow (2: 128 registers).
    "score_cuda_programs_per_sm": 2, "score_cuda_rows_per_thread": 4, "score_cuda_min_blocks": 2, "score_cuda_hist": True,
    # The CUDA score on tensor cores (kernels/cuda/score_tc.cu) where its shapes allow (G <= 8,
    # r % 16 == 0, warps dividing among the KV heads), with this many 16-token tiles per warp per
    # step and a ring of score_cuda_tc_depth steps in registers (depth - 1 steps' loads in flight
    # while one is scored; tiles, then depth, capped by registers: score.py's RING_WORDS).
    # Measured on an H200 against score.cu, the score alone in one call each (results/h200-s17,
    # score_cuda_probe.py): 3 x 64K bf16 20.4 / 19.9 vs 21.9 / 21.5 us, 16 x 32K 45.9 / 45.6 vs
    # 49.6 / 50.5 us (call c); 3 x 128K fp8 27.8 vs 38.9 us (call g). 2 tiles and a ring of 3
    # against 4 tiles and a ring of 2 (results/h200-s20, calls a, b): 3 x 64K 21.7 vs 22.4 us,
    # 16 x 32K 47.3 vs 48.6, fp8 3 x 61440 15.8 vs 16.9; Llama-3.1-8B's DS step at 60K x 3 5.767
    # vs 5.812 ms (score 17.5 vs 18.8 us per layer).
    "score_cuda_tc": True, "score_cuda_tc_tiles": 2, "score_cuda_tc_depth": 3,
    # At most this many KV heads per warp in score_tc.cu (up to 8 / G fill the mma's columns;
    # fewer leave registers for a deeper ring, e.g. for MHA models' 8 heads per warp). Not yet
    # measured below 8 (benchmarks/gpu_s20g.sh).
    "score_cuda_tc_max_heads_per_warp": 8,
    # Programmatic dependent launch on Hopper and later (pdl.py) for the small per-row kernels and
    # the GEMV, whose programs start, and load their weights, while the kernel ahead runs.
    # Off: no GEMV either.
    "pdl": True,
    # Decode projections of at most this many weight bytes (and <= 4 rows) run through the Triton
    # GEMV (gemv.py), which loads its weights before it waits for the kernel ahead; 0 = never.
    "gemv_max_bytes": 8 << 20,
    # Decode projections of at most this many rows (<= 16) and larger weights run through the
    # one-launch split-K GEMM (skinny.py) with PDL instead of cuBLAS; 0 = never. Measured on an
    # H200 (results/h200-s18): Llama-3.1-8B's decode step at 60K x 3 9.86 -> 9.65 ms dense,
    # 6.06 -> 5.83 ms DS. At 16 rows it was about even with cuBLAS (results/h200-s14).
    "skinny_max_rows": 4,
}


def select_prefetches(phase: int) -> bool:
    """Whether the select's phase (2 or 3) loads its keys one block ahead
    (TUNING["select_prefetch"]: phases as digits, or true = "23", false = none)."""
    knob = TUNING["select_prefetch"]
    return str(phase) in {True: "23", False: ""}.get(knob, str(knob))


def tuning_overrides(overrides: dict) -> dict:
    """``overrides`` checked against TUNING's keys (a removed or misspelt knob must not time the
    defaults under its name); returns it."""
    unknown = sorted(set(overrides) - set(TUNING))
    if unknown:
        _fail(f"unknown launch parameters {unknown}; known: {sorted(TUNING)}")
    return overrides


# Benchmarks may override launch parameters without code changes (JSON, e.g. '{"fuse_merge": true}').
TUNING.update(tuning_overrides(json.loads(os.environ.get("DOUBLESPARSE_TUNING", "{}"))))


@functools.lru_cache(maxsize=None)
def _pdl_capable(device: torch.device) -> bool:
    # NVIDIA only: ROCm also reports device type "cuda" (and MI300 a "capability" of 9.4)
    return (device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9)


def pdl_enabled(device: torch.device) -> bool:
    """Whether programmatic dependent launch (pdl.py) is used on ``device``."""
    return bool(TUNING["pdl"]) and HAVE_GDC and not _INTERPRET and _pdl_capable(device)


def pdl_kwargs(device: torch.device) -> dict:
    """Launch kwargs of a kernel that takes part in programmatic dependent launch (pdl.py)."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {}


def _attn_block_n(programs_rows: int, device) -> int:
    # Few (request, head) rows: short tiles and many splits keep enough loads in flight. Many rows
    # (large batches): long tiles amortize the per-tile softmax work (measured on an H200).
    if programs_rows >= _num_sms(device):
        return TUNING["attn_block_n_many_rows"]
    return TUNING["attn_block_n"]


def _attention(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, ws, out,
               sel, rows, heavy_k, threshold, per_head, num_splits, stages=None):
    B, Hq, D = q.shape
    block_n = _attn_block_n(B * rows, q.device)
    G = Hq // k_cache.shape[1]
    S = num_splits
    if not 1 <= S <= ws.max_splits:
        _fail(f"num_splits={S} must be in [1, {ws.max_splits}]")
    po, pl, cnt = ws.part_o, ws.part_lse, ws.split_count
    has_sel = sel is not None
    sel_t = sel if has_sel else seq_lens
    if out is None:
        out = torch.empty_like(q)
    fuse = bool(TUNING["fuse_merge"])
    block_s = triton.next_power_of_2(S)
    decode_attn_kernel[(B, rows, S)](
        q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sel_t, po, pl, cnt, out,
        float(sm_scale), int(heavy_k), int(threshold),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0), sel.stride(0) if has_sel else 0, sel.stride(1) if has_sel else 0,
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        cnt.stride(0), out.stride(0), out.stride(1),
        G=G, D=D, PER_HEAD=per_head, HAS_SEL=has_sel, NUM_SPLITS=S,
        BLOCK_H=max(16, triton.next_power_of_2(1 if per_head else G)), BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(D), DOT_F32=_INTERPRET, FUSE_MERGE=fuse, BLOCK_S=block_s,
        num_warps=TUNING["attn_warps"], num_stages=stages or TUNING["attn_stages"],
    )
    if not fuse:
        merge_kernel[(B, Hq)](
            po, pl, out, po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
            out.stride(0), out.stride(1),
            D=D, NUM_SPLITS=S, BLOCK_S=block_s, BLOCK_D=triton.next_power_of_2(D),
            num_warps=4, **pdl_kwargs(q.device),
        )
    return out


def dense_splits(B: int, Hkv: int, ws: DecodeWorkspace, device) -> int:
    want = triton.cdiv(TUNING["attn_programs_per_sm"] * _num_sms(device), B * Hkv)
    return max(1, min(ws.max_splits, want, triton.cdiv(ws.max_ctx, _attn_block_n(B * Hkv, device))))


def dense_decode(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, ws, out=None,
                 num_splits=None):
    B, Hq, Hkv, D = _check_decode(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, ws, out)
    S = num_splits or dense_splits(B, Hkv, ws, q.device)
    return _attention(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, ws, out,
                      None, Hkv, 0, 0, False, S)


def rope(positions, q, k, cos, sin):
    dev = q.device
    _check(q, "q", 3, _FLOAT, dev)
    _check(k, "k", 3, (q.dtype,), dev)
    _check(positions, "positions", 1, _INDEX, dev)
    _check(cos, "cos", 2, (torch.float32,), dev)
    _check(sin, "sin", 2, (torch.float32,), dev)
    T, Hq, D = q.shape
    if k.shape[0] != T or k.shape[2] != D or positions.shape[0] != T:
        _fail(f"rope: q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)} disagree")
    if D % 2 or cos.shape[1] != D // 2 or sin.shape != cos.shape:
        _fail(f"rope: cos/sin must be [max_pos, {D // 2}], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    qo = torch.empty(q.shape, dtype=q.dtype, device=dev)
    ko = torch.empty(k.shape, dtype=k.dtype, device=dev)
    if T == 0:
        return qo, ko
    Hkv = k.shape[1]
    rope_kernel[(T,)](
        q, k, qo, ko, cos, sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0), qo.stride(1),
        ko.stride(0), ko.stride(1), cos.stride(0),
        HQ=Hq, HKV=Hkv, HALF=D // 2, BLOCK_HQ=triton.next_power_of_2(Hq),
        BLOCK_HKV=triton.next_power_of_2(Hkv), BLOCK_D2=triton.next_power_of_2(D // 2), num_warps=1,
    )
    return qo, ko


# The Double Sparsity launcher lives in ds_launch.py (it builds on the helpers above); callers use
# launch.ds_decode as before.
from .ds_launch import ds_decode  # noqa: E402,F401
