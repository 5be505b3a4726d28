"""Triton decode path of the routed experts: each touched expert's weights streamed once, no
routing layout built on the host side or in separate launches.

Why not the grouped GEMM (moe.py) at decode sizes: there a step is ~10 small device ops that sort
the routing into 16-row blocks, two GEMM launches with 64-wide tiles (few, long programs: at 4
tokens ~360 gate/up programs of 512 KB each, under three waves on 132 SMs), a ``[T * K, H]`` fp32
output and then a sum and a cast. The tensor-core work wasted on padding is not the cost: 16
padded rows are 16 flop per weight byte, ~18x under an H100's ridge.

Here the grid is ``(E, N tiles)``; a program owns one expert and one narrow tile of output
features. It finds its expert's assignments itself (one compare over the ``T * K`` routed ids,
a prefix count to rank them), exits at once when there are none, and runs its tokens through
its weight tile 16 rows at a time (tl.dot's minimum; decode gives 1-16 tokens an expert, so one
pass, and weights are streamed from HBM exactly once; a 17th token re-reads the tile from L2):
  1. gate/up: ``h[a] = silu(x[t] @ Wg[e].T) * (x[t] @ Wu[e].T)`` for assignment ``a = t * K + k``,
     gate and up rows of the tile in one pass; h is ``[T * K, I]`` in x's dtype (L2-resident).
  2. down: ``o[a] = weight[a] * (h[a] @ Wd[e].T)`` in fp32, then the weighted sum over the K
     assignments of each token in the same launch: the last program of an N tile to arrive (an
     arrival counter, reset by that program) sums its tile of ``o`` in the fixed order k = 0..K-1
     (+ the shared experts' output when given) and writes ``y [T, H]`` in x's dtype.
  The shared experts' MLP, when given, is program row E of both launches: one more expert that
  every token takes with weight 1 (its rows of h and o follow the T * K assignments' rows), so it
  streams its weights in the same waves as the routed experts instead of three launches of its own. The counter
     only orders programs; every value is summed in one fixed order, so results are
     deterministic, which fp32 atomic adds into y would not be (for ~4 MB of L2 traffic at 64
     tokens, cheaper than the separate sum launch it replaces).
Narrow tiles (16 gate + 16 up rows, 32 down rows; the defaults of KernelTuning.moe_*) make
thousands of programs of 48-128 KB of weights each at Qwen3-30B-A3B / DeepSeek-V2-Lite sizes, so
no wave tail; 128-wide K steps stream through shared memory 4 stages deep (cp.async: the sizes are
multiples of 16), and at ~104 registers x 8 warps two programs share an SM: ~48 KB of weight
loads in flight per SM.
Static shapes and no host reads: capturable in a CUDA graph at a fixed T.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOAT, INDEX, INTERPRET, check, fail, pdl_kwargs
from .pdl import enter
from ..tuning import DEFAULT_TUNING, KernelTuning

@triton.jit
def _dot_t(w, a, acc, DOT_F32: tl.constexpr):
    """acc + w @ a.T ([BLOCK_N, 16]): the weight tile is the row-major left operand, loaded as it
    lies; DOT_F32: fp32 operands, exact fp32 products (fp32 inputs, the interpreter)."""
    if DOT_F32:
        return tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(a), acc)


@triton.jit
def _expert_rows(ids_ptr, e, TK, TKP: tl.constexpr):
    """(match [TKP] bool, rank [TKP] int32, count): the assignments routed to expert e."""
    a = tl.arange(0, TKP)
    ids = tl.load(ids_ptr + a, mask=a < TK, other=-1)
    match = ids == e
    m32 = match.to(tl.int32)
    return match, tl.cumsum(m32, 0) - 1, tl.sum(m32, 0)


@triton.jit
def _pass_rows(match, rank, c0, count, is_shared, TK, TKP: tl.constexpr):
    """Row of the expert's tokens c0 .. c0 + 15 ([16] int32) and their mask: an assignment index
    ``t * K + k`` for a routed expert, ``TK + t`` for the shared experts (every token)."""
    j = c0 + tl.arange(0, 16)
    a = tl.arange(0, TKP)
    sel = match[None, :] & (rank[None, :] == j[:, None])
    rows = tl.where(is_shared, TK + j, tl.sum(tl.where(sel, a[None, :], 0), 1))
    return rows, j < count


@triton.jit
def _program(ids_ptr, T, TK, E, I, Is, stride_we, stride_wn, stride_wsn,
             TKP: tl.constexpr, SHARED_MLP: tl.constexpr, ALIGNED: tl.constexpr):
    """This program's expert: (match, rank, count, is_shared, its intermediate size, its weights'
    row stride, the offset of its weight matrix in elements). Program E is the shared experts'
    (with SHARED_MLP): every token, weights at the shared pointer."""
    e = tl.program_id(0)
    match, rank, count = _expert_rows(ids_ptr, e, TK, TKP)
    is_shared = SHARED_MLP & (e == E)
    count = tl.where(is_shared, T, count)
    inter = tl.where(is_shared, Is, I)
    sn = tl.where(is_shared, stride_wsn, stride_wn)
    if ALIGNED:  # the sizes and strides are multiples of 16: keeps the K loop's loads vectorized
        inter = tl.multiple_of(inter, 16)
        sn = tl.multiple_of(sn, 16)
    off = tl.where(is_shared, 0, e.to(tl.int64) * stride_we)
    return match, rank, count, is_shared, inter, sn, off


@triton.jit
def moe_decode_gate_up_kernel(
    x_ptr, w_ptr, ws_ptr, ids_ptr, h_ptr, T, TK, E, H, I, Is,
    stride_xt, stride_we, stride_wn, stride_wsn, stride_ht,
    K: tl.constexpr, TKP: tl.constexpr, SHARED_MLP: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, DOT_F32: tl.constexpr,
    PDL: tl.constexpr = False,
):
    enter(PDL)  # ids and x are the kernels ahead's outputs
    n0 = tl.program_id(1) * BLOCK_N
    match, rank, count, is_shared, inter, sn, off = _program(
        ids_ptr, T, TK, E, I, Is, stride_we, stride_wn, stride_wsn, TKP, SHARED_MLP, ALIGNED)
    count = tl.where(n0 < inter, count, 0)
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < inter
    kk = tl.arange(0, BLOCK_K)
    wg_base = tl.where(is_shared, ws_ptr, w_ptr) + off + n[:, None] * sn
    wu_base = wg_base + inter * sn
    for c0 in range(0, count, 16):
        rows, rmask = _pass_rows(match, rank, c0, count, is_shared, TK, TKP)
        tok = tl.where(is_shared, rows - TK, rows // K)
        acc_g = tl.zeros([BLOCK_N, 16], tl.float32)
        acc_u = tl.zeros([BLOCK_N, 16], tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
            k = k0 + kk
            km = k < H
            wm = nmask[:, None] & km[None, :]
            wg = tl.load(wg_base + k[None, :], mask=wm, other=0.0)
            wu = tl.load(wu_base + k[None, :], mask=wm, other=0.0)
            xa = tl.load(x_ptr + tok[:, None] * stride_xt + k[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
            acc_g = _dot_t(wg, xa, acc_g, DOT_F32)
            acc_u = _dot_t(wu, xa, acc_u, DOT_F32)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(h_ptr + rows[None, :] * stride_ht + n[:, None], h.to(h_ptr.dtype.element_ty),
                 mask=rmask[None, :] & nmask[:, None])


@triton.jit
def moe_decode_down_kernel(
    h_ptr, w_ptr, ws_ptr, ids_ptr, wt_ptr, o_ptr, s_ptr, y_ptr, cnt_ptr, T, TK, E, H, I, Is,
    stride_ht, stride_we, stride_wn, stride_wsn, stride_st, stride_yt,
    K: tl.constexpr, TKP: tl.constexpr, SHARED_MLP: tl.constexpr, ALIGNED: tl.constexpr,
    HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
    STAGES: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr = False,
):
    pid_n = tl.program_id(1)
    enter(PDL)  # h: the gate/up launch's output
    match, rank, count, is_shared, inter, sn, off = _program(
        ids_ptr, T, TK, E, I, Is, stride_we, stride_wn, stride_wsn, TKP, SHARED_MLP, ALIGNED)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    kk = tl.arange(0, BLOCK_K)
    w_base = tl.where(is_shared, ws_ptr, w_ptr) + off + n[:, None] * sn
    for c0 in range(0, count, 16):
        rows, rmask = _pass_rows(match, rank, c0, count, is_shared, TK, TKP)
        acc = tl.zeros([BLOCK_N, 16], tl.float32)
        for k0 in tl.range(0, inter, BLOCK_K, num_stages=STAGES):
            k = k0 + kk
            km = k < inter
            w = tl.load(w_base + k[None, :], mask=nmask[:, None] & km[None, :], other=0.0)
            ha = tl.load(h_ptr + rows[:, None] * stride_ht + k[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
            acc = _dot_t(w, ha, acc, DOT_F32)
        routed = rmask & (rows < TK)
        wt = tl.where(routed, tl.load(wt_ptr + rows, mask=routed, other=0.0).to(tl.float32), 1.0)
        tl.store(o_ptr + rows[None, :] * H + n[:, None], acc * wt[None, :], mask=rmask[None, :] & nmask[:, None])
    # o: [TK (+ T), H] fp32. Stores, a block barrier, then the counter's acq_rel atomic publish them to the
    # tile's last program (as skinny.py's split-K does); every program arrives, with tokens or not.
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:
        tl.store(cnt_ptr + pid_n, 0)  # ready for the next call
        for t0 in range(0, T, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            m = (t < T)[:, None] & nmask[None, :]
            tot = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
            for k in tl.static_range(K):
                tot += tl.load(o_ptr + (t * K + k)[:, None] * H + n[None, :], mask=m, other=0.0, cache_modifier=".cg")
            if SHARED_MLP:
                tot += tl.load(o_ptr + (TK + t)[:, None] * H + n[None, :], mask=m, other=0.0, cache_modifier=".cg")
            if HAS_SHARED:
                tot += tl.load(s_ptr + t[:, None] * stride_st + n[None, :], mask=m, other=0.0).to(tl.float32)
            tl.store(y_ptr + t[:, None] * stride_yt + n[None, :], tot.to(y_ptr.dtype.element_ty), mask=m)


# x.device (a tensor's device, so always indexed) -> int32 arrival counters per down N tile, zero
# between calls (each tile's last program resets its own).
_COUNTERS: dict = {}
MAX_TOKENS = 1024  # T * K above this is prefill: moe.py's grouped GEMM (TKP sizes a register tile)


def decode_fits(x, top_k: int, tuning: KernelTuning = DEFAULT_TUNING) -> bool:
    """Whether a step of ``x.shape[0]`` tokens routed to ``top_k`` experts each may take
    :func:`moe_decode`: at most ``tuning.moe_decode_max_tokens`` tokens (0: never) and MAX_TOKENS
    assignments, and outside a graph capture only once an eager call on the device has made its
    counters (the engine warms up before it captures)."""
    on_gpu = x.is_cuda and not INTERPRET
    return (1 <= x.shape[0] <= tuning.moe_decode_max_tokens and x.shape[0] * top_k <= MAX_TOKENS
            and (x.device in _COUNTERS or not (on_gpu and torch.cuda.is_current_stream_capturing())))


def moe_decode(x, w13, w2, weights, ids, shared=None, out=None, shared_w13=None, shared_w2=None,
               tuning: KernelTuning = DEFAULT_TUNING):
    """x: [T, H] float; w13: [E, 2I, H] (per expert gate rows then up rows); w2: [E, H, I] (both
    x's dtype, rows contiguous); weights: [T, K] float; ids: [T, K] int32/int64 in [0, E); shared:
    [T, H] in x's dtype (the shared experts' output, added) or None; shared_w13 [2Is, H] and
    shared_w2 [H, Is] (x's dtype, rows contiguous): the shared experts' MLP, run in the same
    launches as one more expert that every token takes with weight 1, or None; out: [T, H] in x's
    dtype (last dim contiguous) or None -> ``out`` or a new ``[T, H]`` in x's dtype,
    ``sum_k weights[t, k] * down(silu(gate) * up)(x[t])`` (+ shared) (+ the shared MLP's output),
    fp32 accumulation."""
    dev = x.device
    check(x, "x", 2, FLOAT, dev)
    check(w13, "w13", 3, (x.dtype,), dev)
    check(w2, "w2", 3, (x.dtype,), dev)
    check(ids, "ids", 2, INDEX, dev)
    check(weights, "weights", 2, FLOAT, dev)
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter, K = two_i // 2, ids.shape[1]
    if w13.shape[2] != H or two_i % 2:
        fail(f"moe_decode: w13 {tuple(w13.shape)} must be [E, 2 * intermediate, {H}]")
    if tuple(w2.shape) != (E, H, inter):
        fail(f"moe_decode: w2 {tuple(w2.shape)} must be [{E}, {H}, {inter}]")
    if ids.shape[0] != T or tuple(weights.shape) != tuple(ids.shape):
        fail(f"moe_decode: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [{T}, K]")
    if not 1 <= T * K <= MAX_TOKENS:
        fail(f"moe_decode: {T} x {K} assignments; the kernel takes 1..{MAX_TOKENS}")
    for name, t_ in (("shared", shared), ("out", out)):
        if t_ is not None:
            check(t_, name, 2, (x.dtype,), dev)
            if tuple(t_.shape) != (T, H):
                fail(f"moe_decode: {name} {tuple(t_.shape)} must be [{T}, {H}]")
    mlp = shared_w13 is not None
    if mlp != (shared_w2 is not None):
        fail("moe_decode: shared_w13 and shared_w2 come together")
    i_s = 0
    if mlp:
        check(shared_w13, "shared_w13", 2, (x.dtype,), dev)
        check(shared_w2, "shared_w2", 2, (x.dtype,), dev)
        i_s = shared_w13.shape[0] // 2
        if shared_w13.shape[1] != H or shared_w13.shape[0] % 2 or tuple(shared_w2.shape) != (H, i_s):
            fail(f"moe_decode: shared_w13 {tuple(shared_w13.shape)} / shared_w2 {tuple(shared_w2.shape)} must be "
                  f"[2 * Is, {H}] / [{H}, Is]")
    t = tuning
    tk, tkp = T * K, triton.next_power_of_2(T * K)
    ids, wt = ids.contiguous(), weights.reshape(-1).contiguous()
    sw13 = shared_w13 if mlp else w13
    sw2 = shared_w2 if mlp else w2
    aligned = all(v % 16 == 0 for v in (H, inter, i_s, w13.stride(1), w2.stride(1), sw13.stride(0), sw2.stride(0)))
    dot_f32 = INTERPRET or x.dtype == torch.float32
    common = dict(K=K, TKP=tkp, SHARED_MLP=mlp, ALIGNED=aligned, STAGES=t.moe_decode_stages, DOT_F32=dot_f32,
                  num_warps=t.moe_decode_warps, **pdl_kwargs(dev, t))
    grid_e = E + int(mlp)  # program E: the shared experts
    h = torch.empty(tk + (T if mlp else 0), max(inter, i_s), dtype=x.dtype, device=dev)
    bn = t.moe_gate_up_block_n
    moe_decode_gate_up_kernel[(grid_e, triton.cdiv(max(inter, i_s), bn))](
        x, w13, sw13, ids, h, T, tk, E, H, inter, i_s,
        x.stride(0), w13.stride(0), w13.stride(1), sw13.stride(0), h.stride(0),
        BLOCK_N=bn, BLOCK_K=t.moe_decode_block_k, **common)
    tiles = triton.cdiv(H, t.moe_down_block_n)
    cnt = _COUNTERS.get(dev)
    if cnt is None or cnt.numel() < tiles:
        cnt = _COUNTERS[dev] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=dev)
    o = torch.empty(h.shape[0], H, dtype=torch.float32, device=dev)
    y = out if out is not None else torch.empty(T, H, dtype=x.dtype, device=dev)
    s = shared if shared is not None else y
    moe_decode_down_kernel[(grid_e, tiles)](
        h, w2, sw2, ids, wt, o, s, y, cnt, T, tk, E, H, inter, i_s,
        h.stride(0), w2.stride(0), w2.stride(1), sw2.stride(0), s.stride(0), y.stride(0),
        HAS_SHARED=shared is not None, BLOCK_N=t.moe_down_block_n, BLOCK_K=t.moe_decode_block_k,
        BLOCK_T=min(16, triton.next_power_of_2(T)), **common)
    return y
