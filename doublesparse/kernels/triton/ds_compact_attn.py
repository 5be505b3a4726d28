"""Triton kernel: the top-k select's last phase and the sparse attention in one launch.

Runs where phase 3 (ds_topk.py's compact_kernel, or select.cu's ds_select_compact) and the
attention over the selected tokens (decode_attn_kernel) would run, on phase 3's grid (B, rows, P):
program p of a score row first writes the selection of its slice of positions exactly as phase 3
does (same threshold, same offsets, same `sel` / `sel_slot`), then attends over the tokens it has
just selected and stores split p's partial output, which the merge (or, with FUSE_MERGE, the
row's last program) combines. Why: the select's compact phase is a latency-bound chain and the
attention a gather, and the two launches ran one after the other; here nothing waits for the
whole select to finish, and the selected slots are read back from where this program wrote them.

A program's selection lies in two runs of the row's output: its keys above the threshold at
[base, base_end) and its tied keys at n_gt + [base_e, base_e_end), clipped to the row's k. A
request that decodes densely (seq_len <= k or below the threshold) selects nothing; program p then
attends split p of its positions, as the dense decode would.
"""

import triton
import triton.language as tl

from .decode_attn import _attn_tile, _finish_split, _tile_rows
from .ds_select import _sparse_len, _split_range
from .ds_topk import _compact_setup, _emit, _keys_ahead, _next_keys


@triton.jit
def ds_compact_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, req_idx_ptr, seq_lens_ptr,
    scores_ptr, hist_ptr, rowinfo_ptr, counts_ptr, sel_ptr, sel_slot_ptr,
    part_o_ptr, part_lse_ptr, count_ptr, out_ptr,
    sm_scale, heavy_k, threshold,
    stride_qb, stride_qh, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_rt,
    stride_sb, stride_sr, stride_hp, stride_hb, stride_hr, stride_rib, stride_rir, stride_cb, stride_cr,
    stride_selb, stride_selr,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ccb, stride_ob, stride_oh,
    G: tl.constexpr, D: tl.constexpr, PER_HEAD: tl.constexpr, NUM_PROGS: tl.constexpr,
    SLICE_BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, MAX_PROGS: tl.constexpr, PREFETCH: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr,
    FUSE_MERGE: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.program_id(1)
    p = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    req = tl.load(req_idx_ptr + b).to(tl.int64)
    rt_row = req_to_token_ptr + req * stride_rt

    # Phase 3 on this program's slice (SLICE_BLOCK: the slicing of the phase 2 that ran).
    n = _sparse_len(seq_len, heavy_k, threshold)
    sparse = n > 0
    start, end = _split_range(n, p, NUM_PROGS, SLICE_BLOCK)
    srow = scores_ptr + b * stride_sb + row * stride_sr
    ahead = _keys_ahead(srow, start, end, BLOCK_C, PREFETCH)
    h0 = hist_ptr + b * stride_hb + row * stride_hr
    if p == 0:
        # hist[0] has had its last reader (phase 2): leave it zeroed for the next call.
        tl.store(h0 + tl.arange(0, 256), tl.zeros([256], tl.int32))
    thr, n_gt, ties, base, base_e = _compact_setup(
        h0 + stride_hp, stride_hp, counts_ptr + b * stride_cb + row * stride_cr,
        rowinfo_ptr + b * stride_rib + row * stride_rir, heavy_k, p, NUM_PROGS, MAX_PROGS)
    out_pos = sel_ptr + b * stride_selb + row * stride_selr
    out_slot = sel_slot_ptr + b * stride_selb + row * stride_selr
    gt_lo = base
    eq_lo = tl.maximum(base_e, 0)
    for t in range(start, end, BLOCK_C):
        offs = t + tl.arange(0, BLOCK_C)
        key, ahead = _next_keys(srow, ahead, t, end, BLOCK_C, PREFETCH)
        base, base_e = _emit(key, offs, offs < end, thr, n_gt, ties, base, base_e, out_pos, out_slot, rt_row)
    # What this program wrote (the bounds as in _emit), and, for a dense request, its split.
    n_a = tl.maximum(tl.minimum(base, n_gt) - gt_lo, 0)
    eq_lo = n_gt + eq_lo
    n_e = tl.maximum(n_gt + tl.minimum(base_e, ties) - eq_lo, 0)
    d_lo, d_hi = _split_range(seq_len, p, NUM_PROGS, BLOCK_N)
    total = tl.where(sparse, n_a + n_e, tl.maximum(d_hi - d_lo, 0))
    # The slots stored above are read back by other threads of this program: the barrier makes
    # them visible, and the loads skip L1 (.cg), which may hold the row's lines from an earlier call.
    tl.debug_barrier()

    if PER_HEAD:
        kvh = row // G
        heads = row + tl.arange(0, BLOCK_H)
        hmask = tl.arange(0, BLOCK_H) < 1
    else:
        kvh = row
        heads = row * G + tl.arange(0, BLOCK_H)
        hmask = tl.arange(0, BLOCK_H) < G
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634  # exp2-based softmax
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    ar = tl.arange(0, BLOCK_N)
    FULL_D: tl.constexpr = BLOCK_D == D
    for t in range(0, total, BLOCK_N):
        i = t + ar
        nmask = i < total
        idx = tl.where(i < n_a, gt_lo + i, eq_lo + i - n_a)
        picked = tl.load(out_slot + idx, mask=nmask & sparse, other=0, cache_modifier=".cg")
        walked = tl.load(rt_row + d_lo + i, mask=nmask & (sparse == 0), other=0)
        slot = tl.where(sparse, picked, walked).to(tl.int64)
        k = _tile_rows(k_cache_ptr, slot, kvh, stride_kcs, stride_kch, nmask, d, dmask, FULL_D)
        v = _tile_rows(v_cache_ptr, slot, kvh, stride_vcs, stride_vch, nmask, d, dmask, FULL_D)
        m_i, l_i, acc = _attn_tile(q, k, v, nmask, m_i, l_i, acc, qk_scale, DOT_F32)

    _finish_split(acc, m_i, l_i, b, row, p, heads, hmask, d, dmask, part_o_ptr, part_lse_ptr, count_ptr,
                  out_ptr, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ccb, stride_ob,
                  stride_oh, G, D, PER_HEAD, NUM_PROGS, BLOCK_D, FUSE_MERGE, BLOCK_S)
