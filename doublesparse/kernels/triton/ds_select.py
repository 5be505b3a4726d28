"""Triton kernel for Double Sparsity stage 2: exact top-k of the fp16 score rows (a radix select).

Keys are the 16-bit order-preserving images of the fp16 scores; the k-th largest key is found one
byte at a time, in three launches of ``select_kernel`` (PHASE = 1, 2, 3), each on a static grid
(B, rows, P), P programs per score row, each owning one slice of the row; the kernel boundaries
order the phases. Each phase compiles to a kernel named for it (PHASE_NAMES), so profiles tell
them apart:

  1. hist_high_kernel: histogram of the keys' high byte -> hist[0] (atomics, one per non-empty bin)
  2. hist_low_kernel: the high byte d0 holding the k-th largest key (k: the request's own budget,
     k[b]; requests with seq_len <= k are dense and select nothing); per program, the histogram of
     the low byte of its slice's keys whose high byte is d0 -> hist[1 + p], and the count of its
     keys whose high byte is above d0 -> counts[b, row, p]
  3. compact_kernel: the exact 16-bit threshold (d0, d1) from the sum of the programs' low-byte
     histograms; each program writes its slice's positions above the threshold, then as many of
     the keys equal to it as the rank allows, with their cache slots, at offsets summed from the
     programs before it (their high-byte counts and low-byte histograms). So a row's selection
     is the same on every run: the positions above the threshold in increasing order, then the
     first tied positions in increasing order.

Phases 2 and 3 share one geometry (at most workspace.SELECT_MAX_PROGS programs per row). They
load each block of keys one loop iteration ahead, the first before their prologue (measured on an
H200: 0.08 ms less per DS step at 16 x 32K, 3-6 us per layer at one part).
Workspace protocol (no memset launches): phase 3 clears hist[0] after its last reader (phase 2);
phase 2 programs overwrite their own hist[1 + p] and counts.
"""

import triton
import triton.language as tl

from .ds_common import key16, load_block, sparse_len, split_range, threshold_digit

PHASE_NAMES = {1: "hist_high_kernel", 2: "hist_low_kernel", 3: "compact_kernel"}


@triton.jit
def _emit(key, offs, nmask, thr, n_gt, ties, base, base_e, out, out_slot, rt_row):
    # Writes one block's selected positions; returns the advanced output cursors.
    gt = (key > thr) & nmask
    eq = (key == thr) & nmask
    # One scan for both ranks: the "equal" count rides in the high half (a block holds far fewer
    # than 2^16 keys), halving the block-wide prefix sums, the loop's costliest step.
    both = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), 0)
    idx_gt = base + (both & 0xFFFF) - 1
    idx = base_e + (both >> 16) - 1
    # The bounds never bind when the histograms are consistent; they keep a corrupted workspace
    # from writing outside its row.
    w_gt = gt & (idx_gt < n_gt)
    w_eq = eq & (idx < ties) & (idx >= 0)
    dst = tl.where(w_gt, idx_gt, n_gt + idx)
    w = w_gt | w_eq
    slot = tl.load(rt_row + offs, mask=w, other=0)
    tl.store(out + dst, offs, mask=w)
    tl.store(out_slot + dst, slot, mask=w)
    # The scan's last element holds both block totals: one reduction instead of two sums.
    last = tl.max(both, 0)
    return base + (last & 0xFFFF), base_e + (last >> 16)


@triton.jit
def _keys_ahead(srow, t, end, BLOCK_N: tl.constexpr):
    # The fp16 scores of the block at t, loaded ahead of their use (past the program's range,
    # those of block 0: an address always valid, never used).
    t = tl.where(t < end, t, 0)
    return load_block(srow, t + tl.arange(0, BLOCK_N), BLOCK_N)


@triton.jit
def _next_keys(srow, ahead, t, end, BLOCK_N: tl.constexpr):
    # The 16-bit keys of the block at t, loaded one iteration ahead (ahead), and the next block's
    # scores, whose load starts now.
    return key16(ahead), _keys_ahead(srow, t + BLOCK_N, end, BLOCK_N)


def _phase_name(specialization) -> str:
    # The compiled kernel's name: Triton names a kernel after its Python function, so one entry for
    # three phases would show up in profiles as one kernel.
    return PHASE_NAMES[specialization.constants["PHASE"]]


@triton.jit(repr=_phase_name)
def select_kernel(
    scores_ptr, hist_ptr, rowinfo_ptr, counts_ptr, seq_lens_ptr, sel_ptr, sel_slot_ptr,
    req_to_token_ptr, req_idx_ptr, k_ptr, k_max,
    stride_sb, stride_sr, stride_hp, stride_hb, stride_hr, stride_rib, stride_rir,
    stride_cb, stride_cr, stride_selb, stride_selr, stride_rt,
    PHASE: tl.constexpr, NUM_PROGS: tl.constexpr, BLOCK_N: tl.constexpr,
    LOOP_STAGES: tl.constexpr, MAX_PROGS: tl.constexpr,
):
    select_phase(
        tl.program_id(0), tl.program_id(1), tl.program_id(2),
        scores_ptr, hist_ptr, rowinfo_ptr, counts_ptr, seq_lens_ptr, sel_ptr, sel_slot_ptr,
        req_to_token_ptr, req_idx_ptr, k_ptr, k_max,
        stride_sb, stride_sr, stride_hp, stride_hb, stride_hr, stride_rib, stride_rir,
        stride_cb, stride_cr, stride_selb, stride_selr, stride_rt,
        PHASE, NUM_PROGS, BLOCK_N, LOOP_STAGES, MAX_PROGS)


@triton.jit
def select_phase(
    b, row, p, scores_ptr, hist_ptr, rowinfo_ptr, counts_ptr, seq_lens_ptr, sel_ptr, sel_slot_ptr,
    req_to_token_ptr, req_idx_ptr, k_ptr, k_max,
    stride_sb, stride_sr, stride_hp, stride_hb, stride_hr, stride_rib, stride_rir,
    stride_cb, stride_cr, stride_selb, stride_selr, stride_rt,
    PHASE: tl.constexpr, NUM_PROGS: tl.constexpr, BLOCK_N: tl.constexpr,
    LOOP_STAGES: tl.constexpr, MAX_PROGS: tl.constexpr,
):
    # Phase PHASE for slice p of score row (b, row) (select_kernel's body). The row's rank to
    # select is its request's own budget; the sparse/dense choice uses that budget as given (as
    # the score and attention kernels do), the rank is capped at k_max (the sel row's length),
    # which binds only for a budget the host promised never to pass, and keeps the writes inside
    # the row.
    k = tl.load(k_ptr + b)
    n = sparse_len(tl.load(seq_lens_ptr + b), k)
    k = tl.minimum(k, k_max)
    start, end = split_range(n, p, NUM_PROGS, BLOCK_N)
    srow = scores_ptr + b * stride_sb + row * stride_sr
    bins = tl.arange(0, 256)
    h0 = hist_ptr + b * stride_hb + row * stride_hr
    hp = h0 + stride_hp  # hist[1 + p]: program p's low-byte histogram
    cnt = counts_ptr + b * stride_cb + row * stride_cr
    info = rowinfo_ptr + b * stride_rib + row * stride_rir

    if PHASE == 1:  # high-byte histogram
        hist = tl.zeros([256], tl.int32)
        for t in tl.range(start, end, BLOCK_N, num_stages=LOOP_STAGES):
            offs = t + tl.arange(0, BLOCK_N)
            hist += tl.histogram(key16(load_block(srow, offs, BLOCK_N)) >> 8, 256, mask=offs < end)
        tl.atomic_add(h0 + bins, hist, mask=hist > 0, sem="relaxed")

    elif PHASE == 2:  # the high byte of the k-th largest key; per program, the keys above and in it
        # The loop's keys are loaded one block ahead, the first before the threshold's loads and
        # reductions, so that each load's latency overlaps other work.
        ahead = _keys_ahead(srow, start, end, BLOCK_N)
        digit0, above0 = threshold_digit(tl.load(h0 + bins), k)
        if p == 0:
            tl.store(info, digit0)
            tl.store(info + 1, k - above0)
        h1 = hp + p * stride_hp
        n_hi = tl.zeros([BLOCK_N], tl.int32)
        # Only the keys of one high-byte bucket count (a few percent): scattered atomics are
        # cheaper than a full block histogram (measured; the block histogram was removed). This
        # program alone adds to its histogram: clear it first (the barrier orders the stores
        # before the atomics of the other warps).
        tl.store(h1 + bins, tl.zeros([256], tl.int32))
        tl.debug_barrier()
        for t in tl.range(start, end, BLOCK_N, num_stages=LOOP_STAGES):
            offs = t + tl.arange(0, BLOCK_N)
            key, ahead = _next_keys(srow, ahead, t, end, BLOCK_N)
            nmask = offs < end
            n_hi += (((key >> 8) > digit0) & nmask).to(tl.int32)
            inside = nmask & ((key >> 8) == digit0)
            tl.atomic_add(h1 + (key & 255), tl.full([BLOCK_N], 1, tl.int32), mask=inside, sem="relaxed")
        tl.store(cnt + p, tl.sum(n_hi, 0))

    else:  # the exact threshold; write the selection
        ahead = _keys_ahead(srow, start, end, BLOCK_N)
        if p == 0:
            # hist[0] has had its last reader (phase 2): leave it zeroed for the next call.
            tl.store(h0 + bins, tl.zeros([256], tl.int32))
        digit0 = tl.load(info)
        need0 = tl.load(info + 1)
        # Every program's low-byte histogram [MAX_PROGS, 256]: their sum gives the low byte of the
        # threshold; per program, the keys above it and equal to it, whose sums over the programs
        # before this one are its output offsets (no atomics, so no dependence on program order).
        pp = tl.arange(0, MAX_PROGS)
        used = pp < NUM_PROGS
        h = tl.load(hp + pp[:, None] * stride_hp + bins[None, :], mask=used[:, None], other=0)
        digit1, above1 = threshold_digit(tl.sum(h, 0), need0)
        thr = digit0 * 256 + digit1
        n_gt = k - need0 + above1
        ties = k - n_gt
        c_gt = tl.load(cnt + pp, mask=used, other=0) + tl.sum(tl.where(bins[None, :] > digit1, h, 0), 1)
        c_eq = tl.sum(tl.where(bins[None, :] == digit1, h, 0), 1)
        base = tl.sum(tl.where(pp < p, c_gt, 0), 0)
        base_e = tl.sum(tl.where(pp < p, c_eq, 0), 0)
        out = sel_ptr + b * stride_selb + row * stride_selr
        out_slot = sel_slot_ptr + b * stride_selb + row * stride_selr
        rt_row = req_to_token_ptr + tl.load(req_idx_ptr + b).to(tl.int64) * stride_rt
        for t in tl.range(start, end, BLOCK_N, num_stages=LOOP_STAGES):
            offs = t + tl.arange(0, BLOCK_N)
            key, ahead = _next_keys(srow, ahead, t, end, BLOCK_N)
            base, base_e = _emit(key, offs, offs < end, thr, n_gt, ties, base, base_e, out, out_slot,
                                 rt_row)
