"""Triton kernel: write new tokens' K, V and K label into the pools in one launch."""

import triton
import triton.language as tl

from .kv_quant import quantize


@triton.jit
def store_kv_kernel(
    k_ptr, v_ptr, slots_ptr,                      # k, v: [N, Hkv, D]; slots: [N]
    klab_ptr,                                     # the labels' source: [N, Hkv, D] (k, or the unrotated k)
    k_cache_ptr, v_cache_ptr, label_ptr,          # caches: [S, Hkv, D]; label: [S, Hkv, R]
    channels_ptr, scale_ptr,                      # channels: [Hkv, R] int32; scale: [1] f32
    k_scale_ptr, v_scale_ptr,                     # [1] f32 each (fp8 K/V pools)
    N,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_lkn, stride_lkh,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    stride_ls, stride_lh, stride_ch,
    D: tl.constexpr, R: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_LABEL: tl.constexpr, LABEL_FP8: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # One program: BLOCK_T tokens of one KV head.
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < N
    slot = tl.load(slots_ptr + t, mask=tmask, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m2 = tmask[:, None] & (d[None, :] < D)

    k = tl.load(k_ptr + t[:, None] * stride_kn + h * stride_kh + d[None, :], mask=m2)
    v = tl.load(v_ptr + t[:, None] * stride_vn + h * stride_vh + d[None, :], mask=m2)
    if KV_FP8:
        kq = quantize(k, tl.load(k_scale_ptr), k_cache_ptr.dtype.element_ty, FP8_MAX, FP8_MANT, FP8_BIAS, INTERPRET)
        vq = quantize(v, tl.load(v_scale_ptr), v_cache_ptr.dtype.element_ty, FP8_MAX, FP8_MANT, FP8_BIAS, INTERPRET)
    else:
        kq = k.to(k_cache_ptr.dtype.element_ty)
        vq = v.to(v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + slot[:, None] * stride_kcs + h * stride_kch + d[None, :], kq, mask=m2)
    tl.store(v_cache_ptr + slot[:, None] * stride_vcs + h * stride_vch + d[None, :], vq, mask=m2)

    if HAS_LABEL:
        r = tl.arange(0, BLOCK_R)
        rmask = r < R
        ch = tl.load(channels_ptr + h * stride_ch + r, mask=rmask, other=0)
        lm = tmask[:, None] & rmask[None, :]
        # Gathering from global memory (the row was just read, so it is in L1/L2) avoids a
        # register shuffle that Triton has no primitive for.
        lab = tl.load(klab_ptr + t[:, None] * stride_lkn + h * stride_lkh + ch[None, :], mask=lm).to(tl.float32)
        if LABEL_FP8:
            # the reference's (k[ch] / scale).clamp(+-448) rounded to e4m3, bit for bit: plain `/`
            # (2 ulp) moved labels across a rounding boundary, and with them a top-k now and then
            labq = quantize(lab, tl.load(scale_ptr), label_ptr.dtype.element_ty, 448.0, 3, 7, INTERPRET)
        else:
            labq = lab.to(label_ptr.dtype.element_ty)
        tl.store(label_ptr + slot[:, None] * stride_ls + h * stride_lh + r[None, :], labq, mask=lm)
