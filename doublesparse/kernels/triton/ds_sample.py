"""Triton kernels for Double Sparsity stage 2, the "sample" select: exact top-k of the fp16 score
rows in one full pass over the row, bracketed by a sample.

The radix select (ds_topk.py) histograms every key twice before it can write anything. Here a
strided sample of the row says where the k-th largest key lies: the keys above a bracket [lo, hi]
are surely selected and are written at once; the keys inside it (a few percent of the row) are
collected, and one program per row picks the exact remainder among them.

  1. pivot_kernel (B, rows): sample ``min(n, SAMPLE)`` keys at a stride; lo and hi are the
     sample keys at the ranks ``k_s -/+ z * sigma`` around the expected rank
     ``k_s = k * SAMPLE / n`` (sigma: the binomial spread of the sample count above the true
     threshold), found by a 16-way search. A row no longer than the sample is read whole:
     lo = hi = the exact k-th largest key.
  2. split_kernel (B, rows, P): count, then write, the keys above hi (to the selection) and the
     keys in [lo, hi] (to a candidate list, positions and keys); one pair of atomics per program.
  3. resolve_kernel (B, rows): if the bracket held (fewer than k keys above hi, at least k up to
     lo, and the candidates fit or are all ties), the missing ``k - count(> hi)`` are the largest
     candidates: a 16-way search for their threshold over the list, one program. If it did not
     hold (a sample far from the row's distribution: rare), the same program selects over the
     whole row instead, slowly but exactly.

Workspace: rowinfo[0:2] = (lo, hi), rowinfo[2:4] = counters, reset by the score launch.
"""

import triton
import triton.language as tl

from .ds_select import _key16, _load_block, _sparse_len, _split_range


@triton.jit
def _count_ge(key, m, v):
    # [16] counts of the masked keys >= each of the 16 thresholds v.
    return tl.sum(((key[None, :] >= v[:, None]) & m[None, :]).to(tl.int32), 1)


@triton.jit
def _narrow(base, step, counts, rank):
    # One step of a 16-way search: the largest of base + j * step (j < 16) with at least `rank`
    # keys at or above it (counts[0] >= rank holds by induction).
    return base + (tl.sum((counts >= rank).to(tl.int32), 0) - 1) * step


@triton.jit
def _kth_key(key, valid, rank):
    # The rank-th largest (1-based) of the valid 16-bit keys: a 16-way search, 4 bits a step.
    # Comparisons and sums only: a histogram here costs more, its shared-memory atomics
    # serializing on the few bins that a sample's keys crowd into.
    j = tl.arange(0, 16)
    base = tl.full([], 0, tl.int32)
    for i in tl.static_range(4):
        step = 1 << (12 - 4 * i)
        base = _narrow(base, step, _count_ge(key, valid, base + j * step), rank)
    return base


@triton.jit
def pivot_kernel(scores_ptr, rowinfo_ptr, seq_lens_ptr, heavy_k, threshold, z,
                 stride_sb, stride_sr, stride_rib, stride_rir, SAMPLE: tl.constexpr):
    b = tl.program_id(0)
    row = tl.program_id(1)
    n = _sparse_len(tl.load(seq_lens_ptr + b), heavy_k, threshold)
    if n > 0:
        m = tl.minimum(n, SAMPLE)
        i = tl.arange(0, SAMPLE)
        valid = i < m
        pos = i.to(tl.int64) * n // m
        srow = scores_ptr + b * stride_sb + row * stride_sr
        key = _key16(tl.load(srow + pos, mask=valid, other=0.0))
        kf = heavy_k * 1.0
        ks = kf * m.to(tl.float32) / n.to(tl.float32)
        sd = tl.sqrt(ks * (1.0 - kf / n.to(tl.float32)))
        exact = m == n
        hi_rank = tl.where(exact, heavy_k, tl.floor(ks - z * sd).to(tl.int32))
        lo_rank = tl.where(exact, heavy_k, tl.ceil(ks + z * sd).to(tl.int32) + 1)
        # A bracket side past the sample's ends is open: no sample key bounds it with confidence
        # (with few sample keys above the threshold, even the sample's largest may lie below it).
        hi = tl.where(hi_rank < 1, 65535, _kth_key(key, valid, tl.minimum(tl.maximum(hi_rank, 1), m)))
        lo = tl.where(lo_rank > m, 0, _kth_key(key, valid, tl.minimum(tl.maximum(lo_rank, 1), m)))
        info = rowinfo_ptr + b * stride_rib + row * stride_rir
        tl.store(info, lo)
        tl.store(info + 1, hi)


@triton.jit
def split_kernel(scores_ptr, rowinfo_ptr, seq_lens_ptr, sel_ptr, sel_slot_ptr, cand_pos_ptr,
                 cand_key_ptr, req_to_token_ptr, req_idx_ptr, heavy_k, threshold, cap,
                 stride_sb, stride_sr, stride_rib, stride_rir, stride_selb, stride_selr,
                 stride_cb, stride_cr, stride_rt,
                 NUM_PROGS: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    row = tl.program_id(1)
    p = tl.program_id(2)
    n = _sparse_len(tl.load(seq_lens_ptr + b), heavy_k, threshold)
    start, end = _split_range(n, p, NUM_PROGS, BLOCK_N)
    srow = scores_ptr + b * stride_sb + row * stride_sr
    info = rowinfo_ptr + b * stride_rib + row * stride_rir
    lo = tl.load(info)
    hi = tl.load(info + 1)
    # Count first, so the program reserves its output ranges with one pair of atomics (as the
    # radix select's compact does); the second pass re-reads the scores from L2.
    c_gt = tl.full([], 0, tl.int32)
    c_in = tl.full([], 0, tl.int32)
    for t in tl.range(start, end, BLOCK_N):
        offs = t + tl.arange(0, BLOCK_N)
        nmask = offs < end
        key = _key16(_load_block(srow, offs, BLOCK_N))
        c_gt += tl.sum(((key > hi) & nmask).to(tl.int32), 0)
        c_in += tl.sum(((key >= lo) & (key <= hi) & nmask).to(tl.int32), 0)
    base = tl.atomic_add(info + 2, c_gt, mask=c_gt > 0, sem="relaxed")
    base_c = tl.atomic_add(info + 3, c_in, mask=c_in > 0, sem="relaxed")
    out = sel_ptr + b * stride_selb + row * stride_selr
    out_slot = sel_slot_ptr + b * stride_selb + row * stride_selr
    cpos = cand_pos_ptr + b * stride_cb + row * stride_cr
    ckey = cand_key_ptr + b * stride_cb + row * stride_cr
    rt_row = req_to_token_ptr + tl.load(req_idx_ptr + b).to(tl.int64) * stride_rt
    for t in tl.range(start, end, BLOCK_N):
        offs = t + tl.arange(0, BLOCK_N)
        nmask = offs < end
        key = _key16(_load_block(srow, offs, BLOCK_N))
        gt = (key > hi) & nmask
        inside = (key >= lo) & (key <= hi) & nmask
        # Both ranks from one scan: the candidates' count rides in the high half (BLOCK_N < 2^16).
        both = tl.cumsum(gt.to(tl.int32) + (inside.to(tl.int32) << 16), 0)
        idx = base + (both & 0xFFFF) - 1
        idx_c = base_c + (both >> 16) - 1
        # The bounds bind only when the bracket failed (resolve then redoes the row).
        w = gt & (idx < heavy_k)
        w_c = inside & (idx_c < cap)
        slot = tl.load(rt_row + offs, mask=w, other=0)
        tl.store(out + idx, offs, mask=w)
        tl.store(out_slot + idx, slot, mask=w)
        tl.store(cpos + idx_c, offs, mask=w_c)
        tl.store(ckey + idx_c, key.to(tl.int16), mask=w_c)
        base += tl.sum(gt.to(tl.int32), 0)
        base_c += tl.sum(inside.to(tl.int32), 0)


@triton.jit
def _source(srow, cpos, ckey, offs, cnt, use_cand):
    # Block of (position, key) from the candidate list, or from the whole row (the fallback).
    m = offs < cnt
    pos = tl.where(use_cand, tl.load(cpos + offs, mask=m & use_cand, other=0), offs)
    k_c = tl.load(ckey + offs, mask=m & use_cand, other=0).to(tl.int32) & 0xFFFF
    k_r = _key16(tl.load(srow + offs, mask=m & (use_cand == 0), other=0.0))
    return pos, tl.where(use_cand, k_c, k_r), m


@triton.jit
def _emit_resolved(pos, key, m, thr, n_gt, ties, cur, cur_e, out, out_slot, rt_row):
    # Keys above thr to [0, n_gt), the first `ties` keys equal to it after them; returns the
    # advanced cursors (one program per row: blocks in order, so ties go in list order).
    gt = (key > thr) & m
    eq = (key == thr) & m
    both = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), 0)
    idx = cur + (both & 0xFFFF) - 1
    idx_e = cur_e + (both >> 16) - 1
    w = gt | (eq & (idx_e < ties))
    dst = tl.where(gt, idx, n_gt + idx_e)
    slot = tl.load(rt_row + pos, mask=w, other=0)
    tl.store(out + dst, pos, mask=w)
    tl.store(out_slot + dst, slot, mask=w)
    return cur + tl.sum(gt.to(tl.int32), 0), cur_e + tl.sum(eq.to(tl.int32), 0)


@triton.jit
def resolve_kernel(scores_ptr, rowinfo_ptr, seq_lens_ptr, sel_ptr, sel_slot_ptr, cand_pos_ptr,
                   cand_key_ptr, req_to_token_ptr, req_idx_ptr, heavy_k, threshold, cap,
                   stride_sb, stride_sr, stride_rib, stride_rir, stride_selb, stride_selr,
                   stride_cb, stride_cr, stride_rt, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.program_id(1)
    n = _sparse_len(tl.load(seq_lens_ptr + b), heavy_k, threshold)
    if n > 0:
        info = rowinfo_ptr + b * stride_rib + row * stride_rir
        lo = tl.load(info)
        hi = tl.load(info + 1)
        c_gt = tl.load(info + 2)
        c_in = tl.load(info + 3)
        use_cand = (c_gt < heavy_k) & (c_gt + c_in >= heavy_k) & ((c_in <= cap) | (lo == hi))
        cnt = tl.where(use_cand, tl.minimum(c_in, cap), n)
        need = tl.where(use_cand, heavy_k - c_gt, heavy_k)
        out_base = tl.where(use_cand, c_gt, 0)
        srow = scores_ptr + b * stride_sb + row * stride_sr
        cpos = cand_pos_ptr + b * stride_cb + row * stride_cr
        ckey = cand_key_ptr + b * stride_cb + row * stride_cr
        # The first block stays in registers across the three passes: in the common case it is
        # the whole candidate list, and every reload would be a dependent L2 round trip.
        offs0 = tl.arange(0, BLOCK)
        pos0, key0, m0 = _source(srow, cpos, ckey, offs0, cnt, use_cand)
        # The need-th largest key: the 16-way search of _kth_key, over blocks.
        j = tl.arange(0, 16)
        thr = tl.full([], 0, tl.int32)
        for i in tl.static_range(4):
            step = 1 << (12 - 4 * i)
            v = thr + j * step
            counts = _count_ge(key0, m0, v)
            for t in range(BLOCK, cnt, BLOCK):
                _, key, m = _source(srow, cpos, ckey, t + offs0, cnt, use_cand)
                counts += _count_ge(key, m, v)
            thr = _narrow(thr, step, counts, need)
        n_gt = tl.sum(((key0 > thr) & m0).to(tl.int32), 0)
        for t in range(BLOCK, cnt, BLOCK):
            _, key, m = _source(srow, cpos, ckey, t + offs0, cnt, use_cand)
            n_gt += tl.sum(((key > thr) & m).to(tl.int32), 0)
        ties = need - n_gt
        out = sel_ptr + b * stride_selb + row * stride_selr + out_base
        out_slot = sel_slot_ptr + b * stride_selb + row * stride_selr + out_base
        rt_row = req_to_token_ptr + tl.load(req_idx_ptr + b).to(tl.int64) * stride_rt
        cur, cur_e = _emit_resolved(pos0, key0, m0, thr, n_gt, ties, 0, 0, out, out_slot, rt_row)
        for t in range(BLOCK, cnt, BLOCK):
            pos, key, m = _source(srow, cpos, ckey, t + offs0, cnt, use_cand)
            cur, cur_e = _emit_resolved(pos, key, m, thr, n_gt, ties, cur, cur_e, out, out_slot, rt_row)
