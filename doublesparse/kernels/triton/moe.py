"""Triton grouped GEMM for the routed experts of an MoE layer (models/moe.py), graph-capturable.

The T x K (token, expert) assignments of a step are sorted by expert and laid out in blocks of
``BLOCK_M`` rows, each block holding assignments of one expert only (the last block of an expert
is padded with a sentinel row). :func:`align_blocks` builds that layout with device ops of static
shapes (a stable argsort, a scatter-add count, cumsums, a searchsorted): no host syncs, so a
decode step with a fixed T can be captured in a CUDA graph; :func:`align_blocks_launch` builds the
same layout in one launch for decode sizes, where those ops' launch gaps would cost as much time
as reading the experts (see ALIGN_MAX_ASSIGNMENTS). The number of blocks launched is the
static bound ``min(T * K, cdiv(T * K + E * (BLOCK_M - 1), BLOCK_M))``; blocks past the last
expert's exit at once.

Two launches then run every block as a GEMM against its expert's weights:
  1. ``h = silu(x @ W_gate.T) * (x @ W_up.T)`` per assignment row, ``[T * K, I]`` in x's dtype;
  2. ``o = weight * (h @ W_down.T)`` per assignment row, ``[T * K, H]`` float32;
and the K rows of each token are summed and cast (one launch, no atomics: deterministic). Each block
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


# One launch builds the block layout (with align_blocks' ~25 small device ops the expert path took
# a fixed ~41 us beyond streaming its experts on an H100, as long as reading the experts of 4
# tokens: expert_path_fit in results/models-h100.md) when the step has at most this many
# assignments; beyond it, prefill sizes, the device ops.
ALIGN_MAX_ASSIGNMENTS = 1024
_ALIGN_ROWS = 32   # assignments per program
_ALIGN_SLOTS = 64  # layout rows per program


@triton.jit
def _moe_align_kernel(ids_ptr, rows_ptr, bexp_ptr, TK, E, NB,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, ROWS: tl.constexpr, SLOTS: tl.constexpr):
    """align_blocks in one launch. Every program counts the assignments per expert (cheap at decode
    sizes), then places its ROWS assignments (at their expert's first row + how many earlier
    assignments went to that expert: a stable sort) and writes the sentinel into the padding among
    its SLOTS layout rows and the expert of each block starting there. Real rows and padding rows
    are disjoint, so no program waits for another."""
    p = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    jj = tl.arange(0, ROWS)
    for j0 in range(0, TK, ROWS):
        ej = tl.load(ids_ptr + j0 + jj, mask=j0 + jj < TK, other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == ej[None, :]).to(tl.int32), axis=1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pend = tl.cumsum(padded, axis=0)          # one past each expert's last layout row
    base = pend - padded                      # each expert's first layout row
    # this program's assignments
    i = p * ROWS + jj
    imask = i < TK
    ei = tl.load(ids_ptr + i, mask=imask, other=-1).to(tl.int32)
    rank = tl.zeros([ROWS], tl.int32)
    for j0 in range(0, p * ROWS + ROWS, ROWS):
        j = j0 + jj
        ej = tl.load(ids_ptr + j, mask=j < TK, other=-1).to(tl.int32)
        rank += tl.sum(((ei[:, None] == ej[None, :]) & (j[None, :] < i[:, None])).to(tl.int32), axis=1)
    first = tl.sum(tl.where(ei[:, None] == e[None, :], base[None, :], 0), axis=1)
    tl.store(rows_ptr + first + rank, i.to(tl.int64), mask=imask)
    # this program's layout rows: padding -> TK; a block's first row -> the block's expert
    s = p * SLOTS + tl.arange(0, SLOTS)
    smask = s < NB * BLOCK_M
    pend_real = tl.where(e < E, pend, 2147483647)
    es = tl.sum((pend_real[None, :] <= s[:, None]).to(tl.int32), axis=1)   # searchsorted(pend, s, right)
    hit = es[:, None] == e[None, :]
    off = s - tl.sum(tl.where(hit, base[None, :], 0), axis=1)
    cnt = tl.sum(tl.where(hit, counts[None, :], 0), axis=1)
    tl.store(rows_ptr + s, tl.full([SLOTS], 0, tl.int64) + TK, mask=smask & (off >= cnt))
    tl.store(bexp_ptr + s // BLOCK_M, tl.where(es < E, es, -1), mask=smask & (s % BLOCK_M == 0))


def align_blocks_launch(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """align_blocks' contract (the same rows and block experts, bit for bit) in one launch, for
    steps of at most ALIGN_MAX_ASSIGNMENTS assignments."""
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    tk = flat.numel()
    if tk > ALIGN_MAX_ASSIGNMENTS:
        raise ValueError(f"{tk} assignments: the one-launch layout takes at most {ALIGN_MAX_ASSIGNMENTS}")
    if flat.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"expert ids must be int32 or int64, got {flat.dtype}")
    nb = min(tk, triton.cdiv(tk + num_experts * (block_m - 1), block_m))
    rows = torch.empty(nb * block_m, dtype=torch.int64, device=ids.device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=ids.device)
    if tk == 0:
        return rows, block_expert
    grid = max(triton.cdiv(tk, _ALIGN_ROWS), triton.cdiv(nb * block_m, _ALIGN_SLOTS))
    _moe_align_kernel[(grid,)](flat, rows, block_expert, tk, num_experts, nb, BLOCK_M=block_m,
                           BLOCK_E=triton.next_power_of_2(num_experts), ROWS=_ALIGN_ROWS, SLOTS=_ALIGN_SLOTS,
                           num_warps=4)
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


@triton.jit
def _moe_sum_kernel(o_ptr, add_ptr, out_ptr, H, stride_add, K: tl.constexpr, HAS_ADD: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    """out[t] = sum over k of o[t * K + k] (+ add[t]), in float32, stored in out's dtype (the sum,
    the shared experts' add and the cast in one launch, in a fixed order: deterministic)."""
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in range(K):
        acc += tl.load(o_ptr + (t * K + k).to(tl.int64) * H + h, mask=hmask, other=0.0)
    if HAS_ADD:
        acc += tl.load(add_ptr + t.to(tl.int64) * stride_add + h, mask=hmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * H + h, acc.to(out_ptr.dtype.element_ty), mask=hmask)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, block_n: int = 64, block_k: int = 64, num_warps: int = 4,
                  add: torch.Tensor | None = None, one_launch_layout: bool = True) -> torch.Tensor:
    """Same contract as models.moe.experts_torch: x [T, H]; w13 [E, 2I, H]; w2 [E, H, I] (rows
    contiguous); weights [T, K] float; ids [T, K] int64 -> [T, H] in x's dtype; ``add`` [T, H]
    (the shared experts' output; last dim contiguous) is added to the expert sum in float32
    before its one rounding; ``one_launch_layout``: the block layout by :func:`align_blocks_launch`
    where the step fits it (else the device ops of :func:`align_blocks`)."""
    T, H = x.shape
    if add is not None and (tuple(add.shape) != (T, H) or add.stride(1) != 1):
        raise ValueError(f"add must be [{T}, {H}] with a contiguous last dim, got {tuple(add.shape)}")
    if T == 0:
        return torch.empty(0, H, dtype=x.dtype, device=x.device)
    E, two_i, _ = w13.shape
    inter, K = two_i // 2, ids.shape[1]
    tk = T * K
    if one_launch_layout and T * K <= ALIGN_MAX_ASSIGNMENTS:
        rows, bexp = align_blocks_launch(ids, E)
    else:
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
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    _moe_sum_kernel[(T, triton.cdiv(H, 1024))](o, o if add is None else add, out, H, 0 if add is None else add.stride(0),
                                               K=K, HAS_ADD=add is not None, BLOCK_H=1024, num_warps=4)
    return out
