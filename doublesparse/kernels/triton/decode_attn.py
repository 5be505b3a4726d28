"""Triton kernels: split-K decode attention over a token list, and the merge of the partials.

One program handles (batch entry b, row r, split s). A row is a KV head whose whole query group is
packed into the program (so each K/V byte is read once), or, in per-query-head selection, a single
query head. The token list of a row is either positions 0..seq_len-1 (dense) or the row's top-k
selected tokens (sparse: their cache slots, from the select step), k being the request's own
budget (k[b]); which one is decided per request on the device from seq_lens and k.

An fp8 pool (KV_FP8) is read as fp8 rows converted to q's dtype (exact) for the tensor-core dots;
its per-layer scales are applied outside the loop: k_scale into the score scale, v_scale to the
finished output (attention is linear in V), so the inner loop does no extra multiplies.

merge_kernel then merges the partials (merging in the row's last split to finish, with an arrival
counter, measured slower at every shape and was removed).
"""

import triton
import triton.language as tl

from .pdl import enter


@triton.jit
def tile_slots(sel_row, rt_row, offs, end, sparse, HAS_SEL: tl.constexpr):
    # Cache slots of a tile: from the selection (sel holds slots written by the select step,
    # zero-initialised, so even a stale entry is a valid slot) when the request decodes sparsely,
    # else walked from req_to_token. Positions past end read the padding slot 0.
    nmask = offs < end
    if HAS_SEL:
        picked = tl.load(sel_row + offs, mask=nmask & sparse, other=0)
        walked = tl.load(rt_row + offs, mask=nmask & (sparse == 0), other=0)
        return tl.where(sparse, picked, walked).to(tl.int64)
    return tl.load(rt_row + offs, mask=nmask, other=0).to(tl.int64)


@triton.jit
def _tile_rows(cache_ptr, slot, kvh, stride_s, stride_h, rmask, d, dmask, FULL_D: tl.constexpr):
    # [BLOCK_N, BLOCK_D] rows of one KV head; masked rows fetch nothing and read as zero. No
    # channel mask when the head fills the block: even an all-true one blocks vector loads.
    ptrs = cache_ptr + slot[:, None] * stride_s + kvh * stride_h + d[None, :]
    if FULL_D:
        return tl.load(ptrs, mask=rmask[:, None], other=0.0)
    return tl.load(ptrs, mask=rmask[:, None] & dmask[None, :], other=0.0)


@triton.jit
def decode_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr,
    req_to_token_ptr, req_idx_ptr, seq_lens_ptr, sel_ptr,
    part_o_ptr, part_lse_ptr, out_ptr,
    sm_scale, k_ptr, k_max,
    stride_qb, stride_qh,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    stride_rt, stride_selb, stride_selr,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ob, stride_oh,
    G: tl.constexpr, D: tl.constexpr,
    PER_HEAD: tl.constexpr, HAS_SEL: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr,
    row_ks_ptr=None, stride_rkb=0, ROW_KS: tl.constexpr = False,
    k_scale_ptr=None, v_scale_ptr=None, KV_FP8: tl.constexpr = False,
):
    attn_split(
        tl.program_id(0), tl.program_id(1), tl.program_id(2), q_ptr, k_cache_ptr, v_cache_ptr,
        req_to_token_ptr, req_idx_ptr, seq_lens_ptr, sel_ptr, part_o_ptr, part_lse_ptr, out_ptr,
        sm_scale, k_ptr, k_max, stride_qb, stride_qh, stride_kcs, stride_kch, stride_vcs, stride_vch,
        stride_rt, stride_selb, stride_selr,
        stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ob, stride_oh,
        G, D, PER_HEAD, HAS_SEL, NUM_SPLITS, BLOCK_H, BLOCK_N, BLOCK_D, DOT_F32,
        row_ks_ptr, stride_rkb, ROW_KS, k_scale_ptr, v_scale_ptr, KV_FP8)


@triton.jit
def attn_split(
    b, row, split, q_ptr, k_cache_ptr, v_cache_ptr,
    req_to_token_ptr, req_idx_ptr, seq_lens_ptr, sel_ptr,
    part_o_ptr, part_lse_ptr, out_ptr,
    sm_scale, k_ptr, k_max,
    stride_qb, stride_qh,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    stride_rt, stride_selb, stride_selr,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ob, stride_oh,
    G: tl.constexpr, D: tl.constexpr,
    PER_HEAD: tl.constexpr, HAS_SEL: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr,
    row_ks_ptr=None, stride_rkb=0, ROW_KS: tl.constexpr = False,
    k_scale_ptr=None, v_scale_ptr=None, KV_FP8: tl.constexpr = False,
):
    # Split `split` of row (b, row) (decode_attn_kernel's body). ROW_KS (the top-p budget): a
    # sparse request's row attends to the first row_ks[b, row] entries of its selection instead.
    seq_len = tl.load(seq_lens_ptr + b)
    req = tl.load(req_idx_ptr + b).to(tl.int64)
    if HAS_SEL:
        # The request's own budget: sparse iff its length exceeds it; then its first k entries
        # of sel (k capped at k_max, sel's row length, as the select caps it). NUM_SPLITS is
        # sized for the batch's largest k; a row with a smaller one gets shorter splits, and
        # splits past its k are empty (lse -inf), which the merge weighs zero.
        k_b = tl.load(k_ptr + b)
        sparse = seq_len > k_b
        if ROW_KS:
            k_b = tl.load(row_ks_ptr + b * stride_rkb + row)
        n = tl.where(sparse, tl.minimum(k_b, k_max), seq_len)
    else:
        sparse = seq_len < 0  # always False, keeps one code path
        n = seq_len

    if PER_HEAD:
        kvh = row // G
        heads = row + tl.arange(0, BLOCK_H)
        hmask = tl.arange(0, BLOCK_H) < 1
    else:
        kvh = row
        heads = row * G + tl.arange(0, BLOCK_H)
        hmask = tl.arange(0, BLOCK_H) < G

    # Static split count, dynamic split length: the grid never depends on seq_lens.
    per_split = tl.cdiv(tl.cdiv(n, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, n)

    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634  # exp2-based softmax
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    sel_row = sel_ptr + b * stride_selb + row * stride_selr
    rt_row = req_to_token_ptr + req * stride_rt
    ar = tl.arange(0, BLOCK_N)
    FULL_D: tl.constexpr = BLOCK_D == D
    for t in range(start, end, BLOCK_N):
        offs = t + ar
        nmask = offs < end
        slot = tile_slots(sel_row, rt_row, offs, end, sparse, HAS_SEL)
        k = _tile_rows(k_cache_ptr, slot, kvh, stride_kcs, stride_kch, nmask, d, dmask, FULL_D)
        # Issued before the softmax so both rows' loads are in flight together.
        v = _tile_rows(v_cache_ptr, slot, kvh, stride_vcs, stride_vch, nmask, d, dmask, FULL_D)
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if DOT_F32:
            # Triton 3.6's interpreter computes bf16 dots wrongly; upcast there only.
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        elif q.dtype == tl.float32:
            # float32 caches (the tests' references): IEEE products, not TF32's 10-bit mantissas
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale                                         # [BLOCK_H, BLOCK_N], log2 units
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        elif v.dtype == tl.float32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(part_o_ptr + b * stride_pob + heads[:, None] * stride_poh + split * stride_pos + d[None, :],
             out, mask=hmask[:, None] & dmask[None, :])
    tl.store(part_lse_ptr + b * stride_plb + heads * stride_plh + split, lse, mask=hmask)


@triton.jit
def _merge_head(po_row, pl_row, out_row, stride_pos, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse); empty splits have lse -inf.
    s = tl.arange(0, BLOCK_S)
    smask = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    lse = tl.load(pl_row + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - m)
    w = tl.where(smask & (lse > float("-inf")), w, 0.0)
    o_ptrs = po_row + s[:, None] * stride_pos + d[None, :]
    o_mask = (w > 0)[:, None] & dmask[None, :]
    o = tl.load(o_ptrs, mask=o_mask, other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_row + d, out.to(out_row.dtype.element_ty), mask=dmask)


@triton.jit
def merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    stride_ob, stride_oh,
    D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    enter(PDL)  # see pdl.py
    b = tl.program_id(0)
    h = tl.program_id(1)
    _merge_head(part_o_ptr + b * stride_pob + h * stride_poh, part_lse_ptr + b * stride_plb + h * stride_plh,
                out_ptr + b * stride_ob + h * stride_oh, stride_pos, D, NUM_SPLITS, BLOCK_S, BLOCK_D)
