"""Triton kernels that fuse the small elementwise steps of a decoder layer (one launch each).

At decode time a layer's GEMMs and attention are near their byte floors; what remained was ~30
tiny PyTorch launches per layer (RoPE's ~8 binary ops, residual adds, casts, concatenations,
SiLU and mul), which set the step time of small models. Host launchers with argument checks are
in :mod:`.fused_launch`; float32 references in :mod:`doublesparse.kernels.reference`.

RoPE + store is launched with ``enable_fp_fusion=False``: without FMA contraction its fp32
products and sums round exactly as PyTorch's separate elementwise kernels do, so q, k and the
label match the reference (and each other) bit for bit.
"""

import triton
import triton.language as tl

from .kv_quant import quantize
from .pdl import enter


@triton.jit
def rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,   # x, res, out, res_out: [T, N]; w: [N]
    eps, N,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
):
    enter(PDL)  # see pdl.py
    # One program per row: a row of 4096 bf16 is 8 KiB, so one CTA reads it in a few vector loads
    # and the reduction stays inside the CTA (no second pass, no atomics).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    m = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=m, other=0.0).to(tl.float32)
        # The new residual is rounded to the activation dtype (as the unfused ``x + r`` is) and
        # the statistics are taken from the rounded value, so normed == rmsnorm(new_residual).
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, s, mask=m)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    # Rounded once, like F.rms_norm on CUDA (the path this kernel replaces).
    tl.store(out_ptr + row * stride_o + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, I, stride_x, stride_o, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = False):
    """x: [T, 2I] (gate | up) -> out: [T, I] = silu(gate) * up, in fp32, rounded once."""
    enter(PDL)  # see pdl.py
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    g = tl.load(x_ptr + t * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + I + offs, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + t * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _load_halves(src, stride_h, H: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr):
    """The two rotate-half halves of H heads at ``src`` (one token): two [BLOCK_H, BLOCK_D2] fp32."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D2)
    m = (h < H)[:, None] & (d < HALF)[None, :]
    p = src + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _head_norm(x1, x2, w_ptr, eps, HALF: tl.constexpr, BLOCK_D2: tl.constexpr, dtype: tl.constexpr):
    """Per-head RMSNorm of the halves (x1, x2) [BLOCK_H, BLOCK_D2] float32 with weight w [2 HALF]:
    float32 statistics, rounded once to ``dtype`` (as the unfused norm's output) -> (y1, y2 float32,
    1/rms [BLOCK_H])."""
    d = tl.arange(0, BLOCK_D2)
    m = d < HALF
    inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + d, mask=m, other=0.0).to(tl.float32)
    y1 = (x1 * inv[:, None] * w1[None, :]).to(dtype).to(tl.float32)
    y2 = (x2 * inv[:, None] * w2[None, :]).to(dtype).to(tl.float32)
    return y1, y2, inv


@triton.jit
def _store_halves(dst, stride_h, o1, o2, H: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D2)
    m = (h < H)[:, None] & (d < HALF)[None, :]
    p = dst + h[:, None] * stride_h + d[None, :]
    tl.store(p, o1.to(dst.dtype.element_ty), mask=m)
    tl.store(p + HALF, o2.to(dst.dtype.element_ty), mask=m)


@triton.jit
def rope_store_kernel(
    q_ptr, k_ptr, v_ptr,                  # q: [T, Hq, D], k, v: [T, Hkv, D] (last dim contiguous)
    pos_ptr, cos_ptr, sin_ptr, slots_ptr,  # pos, slots: [T]; cos, sin: [P, D/2] f32
    qo_ptr, ko_ptr,                       # qo: [T, Hq, D]; ko: [T, Hkv, D] (if HAS_K_OUT)
    k_cache_ptr, v_cache_ptr, label_ptr,  # caches: [S, Hkv, D]; label: [S, Hkv, R]
    channels_ptr, scale_ptr,              # channels: [Hkv, R] int; scale: [1] f32 (fp8)
    k_scale_ptr, v_scale_ptr,             # [1] f32 each (fp8 K/V pools)
    qn_ptr, kn_ptr, norm_eps,             # per-head RMSNorm weights [D] of q and k (if QK_NORM)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_c,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_kcs, stride_kch, stride_vcs, stride_vch, stride_ls, stride_lh, stride_ch,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, R: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_K_OUT: tl.constexpr, HAS_LABEL: tl.constexpr, LABEL_FP8: tl.constexpr, QK_NORM: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False,
):
    enter(PDL)  # see pdl.py
    # Grid (T, 2): program (t, 0) rotates the token's q heads, (t, 1) its k heads (to the cache),
    # copies v and writes the label. Two programs per token halve the latency at decode (T = B).
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D2)
    c = tl.load(cos_ptr + pos * stride_c + d, mask=d < HALF, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_c + d, mask=d < HALF, other=0.0)[None, :]
    # (The branches use distinct names: Triton rejects a name defined in both with two shapes.)
    if part == 0:
        q1, q2 = _load_halves(q_ptr + t * stride_qt, stride_qh, HQ, HALF, BLOCK_HQ, BLOCK_D2)
        if QK_NORM:  # Qwen3's per-head norm before RoPE
            q1, q2, _ = _head_norm(q1, q2, qn_ptr, norm_eps, HALF, BLOCK_D2, q_ptr.dtype.element_ty)
        _store_halves(qo_ptr + t * stride_qot, stride_qoh, q1 * c - q2 * s, q2 * c + q1 * s,
                      HQ, HALF, BLOCK_HQ, BLOCK_D2)
    else:
        slot = tl.load(slots_ptr + t).to(tl.int64)
        x1, x2 = _load_halves(k_ptr + t * stride_kt, stride_kh, HKV, HALF, BLOCK_HKV, BLOCK_D2)
        kinv = tl.zeros([BLOCK_HKV], tl.float32)
        if QK_NORM:
            x1, x2, kinv = _head_norm(x1, x2, kn_ptr, norm_eps, HALF, BLOCK_D2, k_ptr.dtype.element_ty)
        # Rounded to the activation dtype first: the unfused path stores RoPE's output, which has
        # k's dtype, and the cache may have another one.
        o1 = (x1 * c - x2 * s).to(k_ptr.dtype.element_ty)
        o2 = (x2 * c + x1 * s).to(k_ptr.dtype.element_ty)
        if HAS_K_OUT:
            _store_halves(ko_ptr + t * stride_kot, stride_koh, o1, o2, HKV, HALF, BLOCK_HKV, BLOCK_D2)
        v1, v2 = _load_halves(v_ptr + t * stride_vt, stride_vh, HKV, HALF, BLOCK_HKV, BLOCK_D2)
        if KV_FP8:
            # the rounded k (as the unfused store sees it) / its scale, clamped, to fp8
            kd = k_cache_ptr.dtype.element_ty
            ks = tl.load(k_scale_ptr)
            vs = tl.load(v_scale_ptr)
            o1 = quantize(o1, ks, kd, FP8_MAX, FP8_MANT, FP8_BIAS, INTERPRET)
            o2 = quantize(o2, ks, kd, FP8_MAX, FP8_MANT, FP8_BIAS, INTERPRET)
            v1 = quantize(v1, vs, kd, FP8_MAX, FP8_MANT, FP8_BIAS, INTERPRET)
            v2 = quantize(v2, vs, kd, FP8_MAX, FP8_MANT, FP8_BIAS, INTERPRET)
        _store_halves(k_cache_ptr + slot * stride_kcs, stride_kch, o1, o2, HKV, HALF, BLOCK_HKV, BLOCK_D2)
        _store_halves(v_cache_ptr + slot * stride_vcs, stride_vch, v1, v2, HKV, HALF, BLOCK_HKV, BLOCK_D2)
        if HAS_LABEL:
            h = tl.arange(0, BLOCK_HKV)
            r = tl.arange(0, BLOCK_R)
            lm = (h < HKV)[:, None] & (r < R)[None, :]
            ch = tl.load(channels_ptr + h[:, None] * stride_ch + r[None, :], mask=lm, other=0)
            # Triton has no register gather, so each heavy channel's rotated value is recomputed
            # from the (L1-resident) input row: channel j < HALF is x1*c - x2*s at frequency j,
            # channel j >= HALF is x2*c + x1*s at j - HALF. Same fp32 ops, so the same bits.
            hi = ch >= HALF
            j = tl.where(hi, ch - HALF, ch)
            row = k_ptr + t * stride_kt + h[:, None] * stride_kh
            a = tl.load(row + ch, mask=lm, other=0.0).to(tl.float32)
            bi = tl.where(hi, j, ch + HALF)
            b = tl.load(row + bi, mask=lm, other=0.0).to(tl.float32)
            if QK_NORM:  # the normed values, as the halves above got them
                wa = tl.load(kn_ptr + ch, mask=lm, other=0.0).to(tl.float32)
                wb = tl.load(kn_ptr + bi, mask=lm, other=0.0).to(tl.float32)
                a = (a * kinv[:, None] * wa).to(k_ptr.dtype.element_ty).to(tl.float32)
                b = (b * kinv[:, None] * wb).to(k_ptr.dtype.element_ty).to(tl.float32)
            cj = tl.load(cos_ptr + pos * stride_c + j, mask=lm, other=0.0)
            sj = tl.load(sin_ptr + pos * stride_c + j, mask=lm, other=0.0)
            lab = tl.where(hi, a * cj + b * sj, a * cj - b * sj)
            lab = lab.to(k_ptr.dtype.element_ty).to(tl.float32)
            if LABEL_FP8:
                # IEEE division (plain `/` is div.full.f32, 2 ulp), so the fp8 label is exactly
                # the reference's (k[ch] / scale).clamp(+-448) rounded to e4m3.
                lab = tl.div_rn(lab, tl.load(scale_ptr))
                lab = tl.minimum(tl.maximum(lab, -448.0), 448.0)
            tl.store(label_ptr + slot * stride_ls + h[:, None] * stride_lh + r[None, :],
                     lab.to(label_ptr.dtype.element_ty), mask=lm)


@triton.jit
def lse_merge_kernel(o1_ptr, o2_ptr, lse1_ptr, lse2_ptr, out_ptr, N, D,
                     s1_h, s1_n, s2_h, s2_n, sl1_h, sl2_h, so_h, so_n,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Two attention partials over disjoint key sets -> the attention over their union.

    o1, o2: [H, N, D] (last dim contiguous); lse1, lse2: [H, N] fp32 natural-log log-sum-exps
    (last dim contiguous); out: [H, N, D]. out = (o1 e1 + o2 e2) / (e1 + e2), e_i = exp(lse_i - m),
    m = max(lse1, lse2), in fp32, rounded once.
    """
    h = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    mn = n < N
    m2 = mn[:, None] & (d < D)[None, :]
    l1 = tl.load(lse1_ptr + h * sl1_h + n, mask=mn, other=0.0)
    l2 = tl.load(lse2_ptr + h * sl2_h + n, mask=mn, other=0.0)
    m = tl.maximum(l1, l2)
    e1 = tl.exp(l1 - m)
    e2 = tl.exp(l2 - m)
    inv = 1.0 / (e1 + e2)
    a = tl.load(o1_ptr + h * s1_h + n[:, None] * s1_n + d[None, :], mask=m2, other=0.0).to(tl.float32)
    b = tl.load(o2_ptr + h * s2_h + n[:, None] * s2_n + d[None, :], mask=m2, other=0.0).to(tl.float32)
    y = (a * (e1 * inv)[:, None] + b * (e2 * inv)[:, None])
    tl.store(out_ptr + h * so_h + n[:, None] * so_n + d[None, :], y.to(out_ptr.dtype.element_ty), mask=m2)
