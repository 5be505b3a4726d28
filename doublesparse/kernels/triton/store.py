"""Triton kernel: write new tokens' K, V and K label into the pools in one launch."""

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    k_ptr, v_ptr, slots_ptr,                      # k, v: [N, Hkv, D]; slots: [N]
    k_cache_ptr, v_cache_ptr, label_ptr,          # caches: [S, Hkv, D]; label: [S, Hkv, R]
    channels_ptr, scale_ptr,                      # channels: [Hkv, R] int32; scale: [1] f32
    N,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    stride_ls, stride_lh, stride_ch,
    D: tl.constexpr, R: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_LABEL: tl.constexpr, LABEL_FP8: tl.constexpr,
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
    tl.store(k_cache_ptr + slot[:, None] * stride_kcs + h * stride_kch + d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=m2)
    tl.store(v_cache_ptr + slot[:, None] * stride_vcs + h * stride_vch + d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=m2)

    if HAS_LABEL:
        r = tl.arange(0, BLOCK_R)
        rmask = r < R
        ch = tl.load(channels_ptr + h * stride_ch + r, mask=rmask, other=0)
        lm = tmask[:, None] & rmask[None, :]
        # Gathering from global memory (the row was just read, so it is in L1/L2) avoids a
        # register shuffle that Triton has no primitive for.
        lab = tl.load(k_ptr + t[:, None] * stride_kn + h * stride_kh + ch[None, :], mask=lm).to(tl.float32)
        if LABEL_FP8:
            lab = lab / tl.load(scale_ptr)
            lab = tl.minimum(tl.maximum(lab, -448.0), 448.0)
        tl.store(label_ptr + slot[:, None] * stride_ls + h * stride_lh + r[None, :],
                 lab.to(label_ptr.dtype.element_ty), mask=lm)
