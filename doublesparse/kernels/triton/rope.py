"""Triton kernel: rotate-half RoPE of q and k for one token per program, in one launch.

The PyTorch formulation costs about ten elementwise launches per layer (gather cos/sin, split,
four products, two sums, concat, cast) for each of q and k; at decode time those tiny launches,
not bytes, set the step time of small models.
"""

import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, o_ptr, stride_xt, stride_xh, stride_ot, stride_oh, t, c, s,
                  H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D2)
    m = (h < H)[:, None] & (d < HALF)[None, :]
    src = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    dst = o_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(dst, (x1 * c[None, :] - x2 * s[None, :]).to(o_ptr.dtype.element_ty), mask=m)
    tl.store(dst + HALF, (x2 * c[None, :] + x1 * s[None, :]).to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_c,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D2: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D2)
    c = tl.load(cos_ptr + pos * stride_c + d, mask=d < HALF, other=0.0)
    s = tl.load(sin_ptr + pos * stride_c + d, mask=d < HALF, other=0.0)
    _rotate_heads(q_ptr, qo_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, t, c, s,
                  HQ, HALF, BLOCK_HQ, BLOCK_D2)
    _rotate_heads(k_ptr, ko_ptr, stride_kt, stride_kh, stride_kot, stride_koh, t, c, s,
                  HKV, HALF, BLOCK_HKV, BLOCK_D2)
