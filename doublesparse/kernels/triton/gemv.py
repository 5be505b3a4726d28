"""Triton kernel: ``y = x @ W.T (+ b)`` for a few rows of x, the projections of a small model's decode.

At batch 1 a SmolLM2-135M projection reads 0.7-3.5 MB of weights, which the H200 streams in under
1 us, yet cuBLAS takes ~3.8 us per call (measured; a decode step makes 120 of them): the time is
the launch and the first loads' latency, not bytes. A plain Triton GEMV measured the same. What
this kernel adds is programmatic dependent launch (pdl.py): the weights do not depend on the
kernel ahead in the stream, so each program loads its whole ``[BLOCK_N, K]`` weight slice before
it waits for that kernel, and only the activation row is read after the wait.
"""

import triton
import triton.language as tl

from .pdl import enter


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K,
    stride_xm, stride_wn, stride_ym,
    M: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # One program: BLOCK_N output features, the whole K (BLOCK_K >= K), every one of the M rows.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    k = tl.arange(0, BLOCK_K)
    kmask = k < K
    w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=nmask[:, None] & kmask[None, :],
                other=0.0)
    if HAS_BIAS:
        bias = tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    enter(PDL)  # the weights are in flight; from here on, the previous kernel's output (x)
    for m in tl.static_range(M):
        x = tl.load(x_ptr + m * stride_xm + k, mask=kmask, other=0.0).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * x[None, :], 1)
        if HAS_BIAS:
            acc += bias
        tl.store(y_ptr + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=nmask)
