"""Triton kernel: ``y = x @ W.T (+ b)`` for a few rows of x (decode of small models).

cuBLAS takes ~4 us per projection of SmolLM2-135M at batch 1 (weights of 0.7-3.5 MB, which the
H200 streams in under 1 us), and a decode step makes 120 of them. Here one program owns BLOCK_N
output features for all M (<= 4) rows, reads its [BLOCK_N, K] weight slice once and keeps the M
accumulators in registers.
"""

import triton
import triton.language as tl


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K,
    stride_xm, stride_wn, stride_ym,
    M: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    kk = tl.arange(0, BLOCK_K)
    acc0 = tl.zeros([BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        kmask = k < K
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        x0 = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        acc0 += tl.sum(w * x0[None, :], 1)
        if M > 1:
            x1 = tl.load(x_ptr + stride_xm + k, mask=kmask, other=0.0).to(tl.float32)
            acc1 += tl.sum(w * x1[None, :], 1)
        if M > 2:
            x2 = tl.load(x_ptr + 2 * stride_xm + k, mask=kmask, other=0.0).to(tl.float32)
            acc2 += tl.sum(w * x2[None, :], 1)
        if M > 3:
            x3 = tl.load(x_ptr + 3 * stride_xm + k, mask=kmask, other=0.0).to(tl.float32)
            acc3 += tl.sum(w * x3[None, :], 1)
    if HAS_BIAS:
        bias = tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)
        acc0 += bias
        acc1 += bias
        acc2 += bias
        acc3 += bias
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + n, acc0.to(out_ty), mask=nmask)
    if M > 1:
        tl.store(y_ptr + stride_ym + n, acc1.to(out_ty), mask=nmask)
    if M > 2:
        tl.store(y_ptr + 2 * stride_ym + n, acc2.to(out_ty), mask=nmask)
    if M > 3:
        tl.store(y_ptr + 3 * stride_ym + n, acc3.to(out_ty), mask=nmask)
