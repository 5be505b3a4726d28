"""Triton kernel for Double Sparsity stage 2: exact top-k of the fp16 score rows (a radix select).

Keys are the 16-bit order-preserving images of the fp16 scores; the k-th largest key is found one
byte at a time, in four launches of ``select_kernel`` (PHASE = 1..4), each on a static grid
(B, rows, P), P programs per score row, each owning one slice of the row; the kernel boundaries
order the phases. Each phase compiles to a kernel named for it (PHASE_NAMES), so profiles tell
them apart:

  1. hist_high_kernel: histogram of the keys' high byte -> hist[0] (atomics, one per non-empty bin)
  2. hist_low_kernel: the high byte d0 holding the k-th largest key; histogram of the low byte of
     the keys whose high byte is d0 -> hist[1]
  3. count_kernel: the exact 16-bit threshold; each program counts its slice's keys above it and
     equal to it -> counts[b, row, p]
  4. compact_kernel: each program writes its slice's positions above the threshold, then as many
     of the keys equal to it as the rank allows, with their cache slots, at offsets summed from
     the counts of the programs before it. So a row's selection is the same on every run: the
     positions above the threshold in increasing order, then the tied positions in increasing
     order (the first ``k - above`` of them).

Workspace protocol (no memset launches): the score launch clears hist[1]; phase 3 clears hist[0]
after its last reader (phase 2); phase 4 only reads what phase 3 wrote.
"""

import triton
import triton.language as tl

from .ds_select import _key16, _load_block, _sparse_len, _split_range, _threshold_digit

PHASE_NAMES = {1: "hist_high_kernel", 2: "hist_low_kernel", 3: "count_kernel", 4: "compact_kernel"}


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
    return base + tl.sum(gt.to(tl.int32), 0), base_e + tl.sum(eq.to(tl.int32), 0)


def _phase_name(specialization) -> str:
    # The compiled kernel's name: Triton names a kernel after its Python function, so one entry for
    # three phases would show up in profiles as one kernel.
    return PHASE_NAMES[specialization.constants["PHASE"]]


@triton.jit(repr=_phase_name)
def select_kernel(
    scores_ptr, hist_ptr, rowinfo_ptr, counts_ptr, seq_lens_ptr, sel_ptr, sel_slot_ptr,
    req_to_token_ptr, req_idx_ptr, heavy_k, threshold,
    stride_sb, stride_sr, stride_hp, stride_hb, stride_hr, stride_rib, stride_rir,
    stride_cb, stride_cr, stride_selb, stride_selr, stride_rt,
    PHASE: tl.constexpr, NUM_PROGS: tl.constexpr, BLOCK_N: tl.constexpr,
    ATOMIC_HIST: tl.constexpr, LOOP_STAGES: tl.constexpr, MAX_PROGS: tl.constexpr = 64,
):
    b = tl.program_id(0)
    row = tl.program_id(1)
    p = tl.program_id(2)
    n = _sparse_len(tl.load(seq_lens_ptr + b), heavy_k, threshold)
    start, end = _split_range(n, p, NUM_PROGS, BLOCK_N)
    srow = scores_ptr + b * stride_sb + row * stride_sr
    bins = tl.arange(0, 256)
    h0 = hist_ptr + b * stride_hb + row * stride_hr
    h1 = h0 + stride_hp
    info = rowinfo_ptr + b * stride_rib + row * stride_rir

    if PHASE == 1:  # high-byte histogram
        hist = tl.zeros([256], tl.int32)
        for t in tl.range(start, end, BLOCK_N, num_stages=LOOP_STAGES):
            offs = t + tl.arange(0, BLOCK_N)
            hist += tl.histogram(_key16(_load_block(srow, offs, BLOCK_N)) >> 8, 256, mask=offs < end)
        tl.atomic_add(h0 + bins, hist, mask=hist > 0, sem="relaxed")

    elif PHASE == 2:  # the high byte of the k-th largest key; low-byte histogram inside it
        digit0, above0 = _threshold_digit(tl.load(h0 + bins), heavy_k)
        if p == 0:
            tl.store(info, digit0)
            tl.store(info + 1, heavy_k - above0)
        for t in tl.range(start, end, BLOCK_N, num_stages=LOOP_STAGES):
            offs = t + tl.arange(0, BLOCK_N)
            key = _key16(_load_block(srow, offs, BLOCK_N))
            inside = (offs < end) & ((key >> 8) == digit0)
            if ATOMIC_HIST:
                # Only the keys of one high-byte bucket count (a few percent): scattered atomics
                # are cheaper than a full block histogram.
                tl.atomic_add(h1 + (key & 255), tl.full([BLOCK_N], 1, tl.int32), mask=inside, sem="relaxed")
            else:
                hist = tl.histogram(key & 255, 256, mask=inside)
                tl.atomic_add(h1 + bins, hist, mask=hist > 0, sem="relaxed")

    else:  # phases 3 and 4: the exact threshold; count, then write the selection
        digit0 = tl.load(info)
        need0 = tl.load(info + 1)
        digit1, above1 = _threshold_digit(tl.load(h1 + bins), need0)
        thr = digit0 * 256 + digit1
        n_gt = heavy_k - need0 + above1
        ties = heavy_k - n_gt
        cnt = counts_ptr + b * stride_cb + row * stride_cr
        if PHASE == 3:
            if p == 0:
                # hist[0] has had its last reader (phase 2): leave it zeroed for the next call.
                tl.store(h0 + bins, tl.zeros([256], tl.int32))
            c_gt = tl.full([], 0, tl.int32)
            c_eq = tl.full([], 0, tl.int32)
            for t in tl.range(start, end, BLOCK_N, num_stages=LOOP_STAGES):
                offs = t + tl.arange(0, BLOCK_N)
                nmask = offs < end
                key = _key16(_load_block(srow, offs, BLOCK_N))
                c_gt += tl.sum(((key > thr) & nmask).to(tl.int32), 0)
                c_eq += tl.sum(((key == thr) & nmask).to(tl.int32), 0)
            tl.store(cnt + 2 * p, c_gt)
            tl.store(cnt + 2 * p + 1, c_eq)
        else:
            # This program's output offsets: the counts of the slices before its own. Summed rather
            # than reserved with atomics, so the selection does not depend on program order.
            before = tl.arange(0, MAX_PROGS) < p
            base = tl.sum(tl.load(cnt + 2 * tl.arange(0, MAX_PROGS), mask=before, other=0), 0)
            base_e = tl.sum(tl.load(cnt + 2 * tl.arange(0, MAX_PROGS) + 1, mask=before, other=0), 0)
            out = sel_ptr + b * stride_selb + row * stride_selr
            out_slot = sel_slot_ptr + b * stride_selb + row * stride_selr
            rt_row = req_to_token_ptr + tl.load(req_idx_ptr + b).to(tl.int64) * stride_rt
            for t in tl.range(start, end, BLOCK_N, num_stages=LOOP_STAGES):
                offs = t + tl.arange(0, BLOCK_N)
                key = _key16(_load_block(srow, offs, BLOCK_N))
                base, base_e = _emit(key, offs, offs < end, thr, n_gt, ties, base, base_e, out, out_slot,
                                     rt_row)
