"""Triton grouped GEMM for the routed experts of an MoE layer (models/moe.py), graph-capturable.

The T x K (token, expert) assignments of a step are sorted by expert and laid out in blocks of
``BLOCK_M`` rows, each block holding assignments of one expert only (the last block of an expert
is padded with a sentinel row). :func:`align_blocks` builds that layout with device ops of static
shapes (a stable argsort, a scatter-add count, cumsums, a searchsorted): no host syncs, so a
decode step with a fixed T can be captured in a CUDA graph. The number of blocks launched is the
static bound ``min(T * K, cdiv(T * K + E * (BLOCK_M - 1), BLOCK_M))``; blocks past the last
expert's exit at once.

Two launches then run every block as a GEMM against its expert's weights:
  1. ``h = silu(x @ W_gate.T) * (x @ W_up.T)`` per assignment row, ``[T * K, I]`` in x's dtype;
  2. ``o = weight * (h @ W_down.T)`` per assignment row, ``[T * K, H]`` float32;
and the K rows of each token are summed (one reduction, no atomics: deterministic). Each block
streams its expert's weights once, so a decode step reads each touched expert's weights about
once per block of tokens routed to it: at decode batch sizes, the experts the batch touches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows (assignments) per block: tl.dot's minimum


def align_blocks(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """ids: [T, K] int64 expert per assignment -> (rows [NB * block_m] int64: assignment index
    ``t * K + k`` of each block row, or ``T * K`` for padding; block_expert [NB] int32: the expert of
    each block, -1 past the last). Device ops only."""
    flat = ids.reshape(-1)
    tk = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pend = padded.cumsum(0)
    start = counts.cumsum(0) - counts
    sorted_e = flat[order]
    dest = (pend - padded)[sorted_e] + torch.arange(tk, device=ids.device) - start[sorted_e]
    nb = min(tk, triton.cdiv(tk + num_experts * (block_m - 1), block_m))
    rows = torch.full((nb * block_m,), tk, dtype=torch.int64, device=ids.device)
    rows[dest] = order
    first = torch.arange(nb, device=ids.device) * block_m
    expert = torch.searchsorted(pend, first, right=True)
    block_expert = torch.where(expert < num_experts, expert, -1).to(torch.int32)
    return rows, block_expert


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, rows_ptr, bexp_ptr, h_ptr, TK, H, I,
                    stride_xt, stride_we, stride_wn, stride_ht,
                    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(0)
    e = tl.load(bexp_ptr + b)
    if e < 0:
        return
    rows = tl.load(rows_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    rmask = rows < TK
    tok = tl.where(rmask, rows // K, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    kk = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    for k0 in range(0, H, BLOCK_K):
        k = k0 + kk
        kmask = k < H
        a = tl.load(x_ptr + tok[:, None] * stride_xt + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & nmask[None, :]
        wg = tl.load(w_base + n[None, :] * stride_wn + k[:, None], mask=wmask, other=0.0)
        wu = tl.load(w_base + (n[None, :] + I) * stride_wn + k[:, None], mask=wmask, other=0.0)
        if a.dtype == tl.float32:  # float32 weights (the tests' references): IEEE products, not TF32
            acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, wg, acc_g)
            acc_u = tl.dot(a, wu, acc_u)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(h_ptr + rows[:, None] * stride_ht + n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, rows_ptr, bexp_ptr, wt_ptr, o_ptr, TK, H, I,
                 stride_ht, stride_we, stride_wn, stride_ot,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(0)
    e = tl.load(bexp_ptr + b)
    if e < 0:
        return
    rows = tl.load(rows_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    rmask = rows < TK
    safe = tl.where(rmask, rows, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    for k0 in range(0, I, BLOCK_K):
        k = k0 + kk
        kmask = k < I
        a = tl.load(h_ptr + safe[:, None] * stride_ht + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_base + n[None, :] * stride_wn + k[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
        if a.dtype == tl.float32:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    wt = tl.load(wt_ptr + safe, mask=rmask, other=0.0).to(tl.float32)
    tl.store(o_ptr + rows[:, None] * stride_ot + n[None, :], acc * wt[:, None], mask=rmask[:, None] & nmask[None, :])


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, block_n: int = 64, block_k: int = 64, num_warps: int = 4) -> torch.Tensor:
    """Same contract as models.moe.experts_torch: x [T, H]; w13 [E, 2I, H]; w2 [E, H, I] (rows
    contiguous); weights [T, K] float; ids [T, K] int64 -> [T, H] in x's dtype."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter, K = two_i // 2, ids.shape[1]
    tk = T * K
    rows, bexp = align_blocks(ids, E)
    nb = bexp.numel()
    x = x.contiguous()
    h = torch.empty(tk, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(nb, triton.cdiv(inter, block_n))](
        x, w13, rows, bexp, h, tk, H, inter, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        K=K, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    o = torch.empty(tk, H, dtype=torch.float32, device=x.device)
    wt = weights.reshape(-1).contiguous()
    _down_kernel[(nb, triton.cdiv(H, block_n))](
        h, w2, rows, bexp, wt, o, tk, H, inter, h.stride(0), w2.stride(0), w2.stride(1), o.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return o.view(T, K, H).sum(1).to(x.dtype)
