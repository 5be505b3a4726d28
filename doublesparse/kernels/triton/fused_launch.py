"""Host launchers for the fused layer kernels (:mod:`.fused`): checks, launch geometry, no syncs.

As in :mod:`.launch`, the checks read only shapes, dtypes, strides and devices, and the grids
depend only on static sizes (and the ``KernelTuning``), so every launcher is capturable in a CUDA
graph.
"""

from __future__ import annotations

import torch
import triton

from .fused import lse_merge_kernel, rmsnorm_kernel, rope_store_kernel, silu_mul_kernel
from .gemv import gemv_kernel
from .skinny import skinny_gemm_kernel
from ..tuning import DEFAULT_TUNING, KernelTuning
from .common import (FLOAT, INDEX, INTERPRET, check, check_caches, check_labels, check_rope_tables, fail,
                     kv_scale_args, num_sms, pdl_enabled, pdl_kwargs)
from .kv_quant import fp8_constexprs

SILU_BLOCK = 1024


def _norm_warps(block: int) -> int:
    # ~8 elements (one 16-byte bf16 vector) per thread: 576 -> 4 warps, 4096 -> 16 warps.
    return max(1, min(16, block // 256))


def rms_norm(x, weight, eps: float, residual=None, tuning: KernelTuning = DEFAULT_TUNING):
    """x: [T, N] float; weight: [N]; residual: [T, N] in x's dtype or None.

    Returns ``normed`` [T, N] (x's dtype), or ``(normed, x + residual)`` when residual is given;
    both are new contiguous tensors.
    """
    dev = x.device
    check(x, "x", 2, FLOAT, dev)
    T, N = x.shape
    check(weight, "weight", 1, FLOAT, dev)
    if weight.shape[0] != N:
        fail(f"rms_norm: weight has {weight.shape[0]} entries for rows of {N}")
    out = torch.empty((T, N), dtype=x.dtype, device=dev)
    has_res = residual is not None
    if has_res:
        check(residual, "residual", 2, (x.dtype,), dev)
        if residual.shape != x.shape:
            fail(f"rms_norm: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
        res_out = torch.empty_like(out)
    else:
        residual = res_out = x  # placeholders the kernel never touches (HAS_RES=False)
    if T:
        block = triton.next_power_of_2(N)
        rmsnorm_kernel[(T,)](
            x, residual, weight, out, res_out, float(eps), N,
            x.stride(0), residual.stride(0), out.stride(0), res_out.stride(0),
            HAS_RES=has_res, BLOCK_N=block, num_warps=_norm_warps(block), **pdl_kwargs(dev, tuning),
        )
    return (out, res_out) if has_res else out


def silu_mul(x, tuning: KernelTuning = DEFAULT_TUNING):
    """x: [T, 2I] float (gate | up) -> [T, I] = silu(gate) * up in x's dtype."""
    dev = x.device
    check(x, "x", 2, FLOAT, dev)
    T, two_i = x.shape
    if two_i % 2:
        fail(f"silu_mul: last dim {two_i} is not 2 * intermediate")
    I = two_i // 2
    out = torch.empty((T, I), dtype=x.dtype, device=dev)
    if T and I:
        silu_mul_kernel[(T, triton.cdiv(I, SILU_BLOCK))](
            x, out, I, x.stride(0), out.stride(0), BLOCK=SILU_BLOCK, num_warps=4,
            **pdl_kwargs(dev, tuning))
    return out


def lse_merge(o1, o2, lse1, lse2):
    """Attention over the union of two disjoint key sets from its two partials, one pass.

    o1, o2: [H, N, D] bf16/fp16/fp32 (last dim contiguous); lse1, lse2: [H, N] float32
    (natural-log log-sum-exp of each partial's scores). Returns [H, N, D] contiguous, o1's dtype,
    computed in fp32 and rounded once (the same math as prefill._split_prefix's PyTorch merge).
    """
    dev = o1.device
    check(o1, "o1", 3, FLOAT, dev)
    check(o2, "o2", 3, (o1.dtype,), dev)
    check(lse1, "lse1", 2, (torch.float32,), dev)
    check(lse2, "lse2", 2, (torch.float32,), dev)
    H, N, D = o1.shape
    if o2.shape != o1.shape or tuple(lse1.shape) != (H, N) or lse2.shape != lse1.shape:
        fail(f"lse_merge: o1 {tuple(o1.shape)}, o2 {tuple(o2.shape)}, lse1 {tuple(lse1.shape)}, "
              f"lse2 {tuple(lse2.shape)} disagree")
    out = torch.empty((H, N, D), dtype=o1.dtype, device=dev)
    if H and N and D:
        block_d = triton.next_power_of_2(D)
        block_n = max(1, 4096 // block_d)
        lse_merge_kernel[(H, triton.cdiv(N, block_n))](
            o1, o2, lse1, lse2, out, N, D, o1.stride(0), o1.stride(1), o2.stride(0), o2.stride(1),
            lse1.stride(0), lse2.stride(0), out.stride(0), out.stride(1),
            BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4)
    return out


def rope_store(positions, q, k, v, cos, sin, k_cache, v_cache, slots, label_cache=None,
               label_scale=None, channels=None, return_k: bool = False, tuning: KernelTuning = DEFAULT_TUNING,
               k_scale=None, v_scale=None, qk_norm=None):
    """Rotate q and k (rotate-half RoPE, fp32, rounded once to q's dtype), write rotated k, v and
    the label of rotated k into the pools at ``slots``; one launch.

    positions, slots: [T] int32/int64; q: [T, Hq, D]; k, v: [T, Hkv, D] (any token/head strides,
    last dim contiguous: views into the merged qkv GEMM output are fine); cos, sin: [P, D/2]
    float32; caches, labels and an fp8 pool's k_scale / v_scale as in :func:`.launch.store_kv`.
    ``qk_norm``: None, or ``(q_weight [D], k_weight [D], eps)``: each head of q and k RMS-normed
    first (Qwen3), rounded to q's dtype as the unfused norm's output is.
    Returns ``(q_rot [T, Hq, D] contiguous, k_rot [T, Hkv, D] contiguous or None)``.
    """
    dev = q.device
    check(q, "q", 3, FLOAT, dev)
    check(k, "k", 3, (q.dtype,), dev)
    check(v, "v", 3, FLOAT, dev)
    check(slots, "slots", 1, INDEX, dev)
    check_caches(k_cache, v_cache, dev, k_scale, v_scale)
    T, Hq, D = q.shape
    check_rope_tables("rope_store", positions, cos, sin, D, dev)
    Hkv = k.shape[1]
    if tuple(k.shape) != (T, Hkv, D) or tuple(v.shape) != (T, Hkv, D):
        fail(f"rope_store: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if positions.shape[0] != T or slots.shape[0] != T:
        fail(f"rope_store: positions {tuple(positions.shape)} / slots {tuple(slots.shape)} must be [{T}]")
    if Hq % Hkv:
        fail(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    if tuple(k_cache.shape[1:]) != (Hkv, D):
        fail(f"k is [T, {Hkv}, {D}] but k_cache is {tuple(k_cache.shape)}")
    has_label = label_cache is not None
    r = check_labels(label_cache, label_scale, channels, k_cache, dev) if has_label else 1
    is_fp8 = has_label and label_cache.dtype == torch.float8_e4m3fn
    qo = torch.empty((T, Hq, D), dtype=q.dtype, device=dev)
    ko = torch.empty((T, Hkv, D), dtype=q.dtype, device=dev) if return_k else None
    if T == 0:
        return qo, ko
    ko_t = ko if return_k else qo          # placeholders for the constexpr-disabled paths
    lab = label_cache if has_label else k_cache
    ch = channels if has_label else slots
    scale = label_scale if is_fp8 else cos
    ks, vs, _ = kv_scale_args(k_cache, k_scale, v_scale)
    if qk_norm is not None:
        qn, kn, norm_eps = qk_norm
        check(qn, "q norm weight", 1, FLOAT, dev)
        check(kn, "k norm weight", 1, FLOAT, dev)
        if qn.shape[0] != D or kn.shape[0] != D:
            fail(f"rope_store: q/k norm weights {tuple(qn.shape)} / {tuple(kn.shape)} must be [{D}]")
    else:
        qn, kn, norm_eps = cos, cos, 0.0   # placeholders for the constexpr-disabled path
    rope_store_kernel[(T, 2)](
        q, k, v, positions, cos, sin, slots, qo, ko_t, k_cache, v_cache, lab, ch, scale, ks, vs,
        qn, kn, float(norm_eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        qo.stride(0), qo.stride(1), ko_t.stride(0), ko_t.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        lab.stride(0), lab.stride(1), ch.stride(0),
        HQ=Hq, HKV=Hkv, HALF=D // 2, R=r,
        BLOCK_HQ=triton.next_power_of_2(Hq), BLOCK_HKV=triton.next_power_of_2(Hkv),
        BLOCK_D2=triton.next_power_of_2(D // 2), BLOCK_R=triton.next_power_of_2(r),
        HAS_K_OUT=return_k, HAS_LABEL=has_label, LABEL_FP8=is_fp8, QK_NORM=qk_norm is not None,
        **fp8_constexprs(k_cache.dtype), INTERPRET=INTERPRET,
        num_warps=4, enable_fp_fusion=False, **pdl_kwargs(dev, tuning),
    )
    return qo, ko


# The whole [BLOCK_N, K] weight slice of a program sits in registers: at most this many elements
# (64 per thread at 4 warps).
GEMV_TILE = 8192
GEMV_MAX_ROWS = 4


def gemv_fits(x, weight, tuning: KernelTuning = DEFAULT_TUNING) -> bool:
    """Whether :func:`gemv` takes ``F.linear(x, weight)``: a CUDA decode projection of at most
    GEMV_MAX_ROWS rows whose weights are at most ``tuning.gemv_max_bytes`` (0: never), where
    programmatic dependent launch is on (without it the kernel only matches cuBLAS)."""
    return (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_ROWS and pdl_enabled(x.device, tuning)
            and x.dtype in FLOAT and weight.dtype == x.dtype and weight.dim() == 2
            and weight.shape[1] <= GEMV_TILE and x.stride(-1) == 1 and weight.stride(-1) == 1
            and weight.numel() * weight.element_size() <= tuning.gemv_max_bytes)


def _check_projection(name, x, weight, bias, max_rows):
    """(M, N, K) of ``x @ weight.T + bias`` once the operands are checked (ValueError if not)."""
    dev = x.device
    check(x, "x", 2, FLOAT, dev)
    check(weight, "weight", 2, (x.dtype,), dev)
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        fail(f"{name}: weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    if not 1 <= M <= max_rows:
        fail(f"{name}: {M} rows; the kernel takes 1..{max_rows}")
    if bias is not None:
        check(bias, "bias", 1, (x.dtype,), dev)
        if bias.shape[0] != N:
            fail(f"{name}: bias has {bias.shape[0]} entries for {N} outputs")
    return M, N, K


def gemv(x, weight, bias=None, tuning: KernelTuning = DEFAULT_TUNING):
    """x: [M, K] float (M <= GEMV_MAX_ROWS); weight: [N, K] (x's dtype); bias: [N] or None ->
    [M, N] in x's dtype, fp32 accumulation. See :mod:`.gemv`."""
    dev = x.device
    M, N, K = _check_projection("gemv", x, weight, bias, GEMV_MAX_ROWS)
    if K > GEMV_TILE:
        fail(f"gemv: K={K} > {GEMV_TILE}")
    y = torch.empty((M, N), dtype=x.dtype, device=dev)
    block_k = triton.next_power_of_2(K)
    # About one program per SM or more, each a few KB of weights, all resident at once.
    per_sm = max(1, N // num_sms(dev))
    block_n = max(1, min(GEMV_TILE // block_k, 1 << (per_sm.bit_length() - 1)))
    gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, y, N, K,
        x.stride(0), weight.stride(0), y.stride(0),
        M=M, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        **pdl_kwargs(dev, tuning),
    )
    return y


SKINNY_MAX_ROWS = 16  # the kernel pads x to 16 rows
# bf16 / fp16 only: Triton's dot would run fp32 operands as tf32, less exact than cuBLAS's fp32.
_HALF = (torch.bfloat16, torch.float16)
# x.device (a tensor's device, so always indexed) -> int32 arrival counters per N tile, zero between
# calls (each tile's last program resets its own).
_SKINNY_COUNTERS: dict = {}


def skinny_fits(x, weight, tuning: KernelTuning = DEFAULT_TUNING) -> bool:
    """Whether :func:`skinny_gemm` takes ``F.linear(x, weight)``: a CUDA decode projection in bf16
    or fp16 of at most ``tuning.skinny_max_rows`` rows (0: never) whose weights are too large
    for the GEMV, where programmatic dependent launch is on, outside a graph capture until the
    first eager call on the device has made its counters (the engine warms up before it captures)."""
    return (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= min(tuning.skinny_max_rows, SKINNY_MAX_ROWS)
            and pdl_enabled(x.device, tuning) and x.dtype in _HALF and weight.dtype == x.dtype and weight.dim() == 2
            and x.stride(-1) == 1 and weight.stride(-1) == 1
            and weight.numel() * weight.element_size() > tuning.gemv_max_bytes
            and (x.device in _SKINNY_COUNTERS or not torch.cuda.is_current_stream_capturing()))


def skinny_gemm(x, weight, bias=None, split_k=None, tuning: KernelTuning = DEFAULT_TUNING):
    """x: [M, K] bf16 / fp16 (M <= 16); weight: [N, K] (x's dtype); bias: [N] or None -> [M, N]
    in x's dtype, fp32 accumulation, one launch. ``split_k``: K ranges per N tile (default: about
    two programs per SM). See :mod:`.skinny`."""
    dev = x.device
    M, N, K = _check_projection("skinny_gemm", x, weight, bias, SKINNY_MAX_ROWS)
    if x.dtype not in _HALF:
        fail(f"skinny_gemm: x is {x.dtype}; the kernel takes bf16 or fp16")
    block_n, block_k = 64, 128
    tiles = triton.cdiv(N, block_n)
    if split_k is None:  # a power of two near two programs per SM (the H200's best)
        per = max(1, 2 * num_sms(dev) // tiles)
        split_k = min(8, 1 << (per.bit_length() - 1))
    if not 1 <= split_k <= 64:
        fail(f"skinny_gemm: split_k {split_k} outside 1..64")
    cnt = _SKINNY_COUNTERS.get(dev)
    if cnt is None or cnt.numel() < tiles:
        cnt = _SKINNY_COUNTERS[dev] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=dev)
    part = torch.empty(split_k * 16 * N if split_k > 1 else 1, dtype=torch.float32, device=dev)
    y = torch.empty((M, N), dtype=x.dtype, device=dev)
    skinny_gemm_kernel[(tiles, split_k)](
        x, weight, bias if bias is not None else weight, y, part, cnt, M, N, K,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, STAGES=3,
        DOT_F32=INTERPRET, num_warps=4, **pdl_kwargs(dev, tuning),
    )
    return y
