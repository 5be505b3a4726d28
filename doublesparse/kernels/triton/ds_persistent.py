"""Triton kernel: the whole Double Sparsity decode of a batch in one persistent launch.

The separate launches (score -> select's three phases -> attention) run one after another for
the whole batch, so the select's latency-bound phases leave the memory system idle. Here every
stage of every batch entry is a *work item* (kind, b, row, p) in one table (ds_persistent_launch.py
builds it, in an order that staggers the batch entries: with the default lags entry b's select is
queued after entry b + 1's score, its attention after entry b + 2's). Each program takes the next item by an atomic
ticket (the next ticket, and its item, read while it works on this one), waits until the items
it depends on have finished (per-entry and per-row arrival counters), runs it with the same code
as the separate kernels, then signals its arrival. So one entry's select runs while the next
entries' labels and K/V stream.

    kind 0 SCORE   (b, -, slice)   score_mma_slice: all score rows of entry b over one slice
    kind 1 HIST1   (b, row, slice) select phase 1 (high-byte histogram), after all SCOREs of b
                                   (none with SCORE_HIST: the SCOREs make the histogram)
    kind 2 HIST2   (b, row, slice) select phase 2, after all HIST1s of (b, row) (SCORE_HIST:
                                   after all SCOREs of b)
    kind 3 COMPACT (b, row, slice) select phase 3, after all HIST2s of (b, row)
    kind 4 ATTN    (b, row, split) attention split over the selection (dense rows: their whole
                                   cache), after all COMPACTs of (b, row); the row's last split
                                   merges the partials (decode_attn's FUSE_MERGE)

No deadlock, whatever the number of programs resident: tickets are taken in table order by
running programs, every item depends only on items earlier in the table, and a program holding
two tickets works on the earlier one first; so, by induction over the table, every item's
dependencies finish and so does whatever its program works on before it. (Under the CPU
interpreter the first program runs every item in order.)

Memory ordering: an item's stores, then a barrier, then one gpu-scope release increment of its
counter; a waiting program polls with volatile loads, then reads the counter once with acquire
semantics (``_wait``) and passes a barrier before it reads the item's inputs. The counters (``sync``, per batch entry: [score, hist1[rows], hist2[rows], compact[rows]],
then the ticket and the exit count in entry 0's row) are zeroed by the last program to exit.
With SPIN_LIMIT > 0 a wait gives up after that many polls and records itself in the six columns
after the exit count, which the host reports (a debugging aid: a hang becomes an error).
"""

import triton
import triton.language as tl

from .decode_attn import attn_split
from .ds_score import score_mma_slice
from .ds_topk import select_phase

SCORE, HIST1, HIST2, COMPACT, ATTN = 0, 1, 2, 3, 4
ITEM_FIELDS = tl.constexpr(4)  # kind, b, row, p


@triton.jit
def _wait(cnt_ptr, need, item, stall_ptr, SPIN_LIMIT: tl.constexpr):
    # Spin until *cnt_ptr >= need: volatile loads (served by L2, lighter than atomics on an address
    # that many programs poll), then an acquire read that synchronizes with the releases it saw,
    # then a barrier so every thread reads after it. Triton emits the acquire add of 0 as an
    # acquire load (ld.global.gpu.acquire), and drops it when its result is unused (both seen in
    # the sm_90 PTX), so its value feeds a loop, which never runs: the count only grows.
    # SPIN_LIMIT > 0 (a debugging aid, knob persistent_spin_limit): give up after that many polls
    # and record the first stalled wait in stall[0:6] = (ticket + 1, count seen, kind, b, row, p)
    # for the host to report, instead of hanging the GPU; ``item`` is (ticket, kind, b, row, p).
    c = tl.load(cnt_ptr, volatile=True)
    if SPIN_LIMIT == 0:
        while c < need:
            c = tl.load(cnt_ptr, volatile=True)
        c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        while c < need:
            c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    else:
        n = 0
        while (c < need) & (n < SPIN_LIMIT):
            c = tl.load(cnt_ptr, volatile=True)
            n += 1
        c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        if c < need:
            if tl.atomic_cas(stall_ptr, 0, item[0] + 1, sem="relaxed", scope="gpu") == 0:
                tl.store(stall_ptr + 1, c)
                for i in tl.static_range(1, 5):
                    tl.store(stall_ptr + 1 + i, item[i])
    tl.debug_barrier()


@triton.jit
def _item(items_ptr, t, num_items):
    # Fields (kind, b, row, p) of item t; zeros past the table.
    ok = t < num_items
    item = items_ptr + t * ITEM_FIELDS
    return (tl.load(item, mask=ok, other=0), tl.load(item + 1, mask=ok, other=0),
            tl.load(item + 2, mask=ok, other=0), tl.load(item + 3, mask=ok, other=0))


@triton.jit
def _signal(cnt_ptr):
    # Every thread's stores of the item, then one release increment.
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")


# Each kind's code is a separate (noinline) function: inlined into the item loop, LLVM hoists the
# kinds' loop-invariant tiles out of it and keeps them all live (sm_90, Llama-3.1-8B's shapes: 255
# registers and 184 bytes of stack, against 160 registers so: benchmarks/kernel_resources.py
# --persistent [--inline], compiled on a CPU machine).
@triton.jit(noinline=True)
def _score_item(
    b, p, q_ptr, label_ptr, channels_ptr, scale_ptr, req_to_token_ptr, req_idx_ptr, seq_lens_ptr,
    scores_ptr, sm_scale, heavy_k, threshold, num_sink, num_recent,
    stride_qb, stride_qh, stride_ls, stride_lh, stride_ch, stride_rt, stride_sb, stride_sr,
    hist_ptr, stride_hb, stride_hr,
    HKV: tl.constexpr, G: tl.constexpr, R: tl.constexpr, MODE: tl.constexpr, LABEL_FP8: tl.constexpr,
    LABEL_KIND: tl.constexpr, NUM_PROGS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    HKV_P: tl.constexpr, G_P: tl.constexpr, DOT_F32: tl.constexpr, DO_HIST: tl.constexpr,
):
    score_mma_slice(
        b, p, q_ptr, label_ptr, channels_ptr, scale_ptr, req_to_token_ptr, req_idx_ptr, seq_lens_ptr,
        scores_ptr, sm_scale, heavy_k, threshold, num_sink, num_recent,
        stride_qb, stride_qh, stride_ls, stride_lh, stride_ch, stride_rt, stride_sb, stride_sr,
        hist_ptr, stride_hb, stride_hr,
        HKV, G, R, MODE, LABEL_FP8, LABEL_KIND, NUM_PROGS, BLOCK_N, BLOCK_C, HKV_P, G_P, DOT_F32, DO_HIST)


@triton.jit(noinline=True)
def _select_item(
    b, row, p, scores_ptr, hist_ptr, rowinfo_ptr, counts_ptr, seq_lens_ptr, sel_ptr, sel_slot_ptr,
    req_to_token_ptr, req_idx_ptr, heavy_k, threshold,
    stride_sb, stride_sr, stride_hp, stride_hb, stride_hr, stride_rib, stride_rir,
    stride_cb, stride_cr, stride_selb, stride_selr, stride_rt,
    PHASE: tl.constexpr, NUM_PROGS: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC_HIST: tl.constexpr,
    LOOP_STAGES: tl.constexpr, MAX_PROGS: tl.constexpr, PREFETCH: tl.constexpr,
):
    select_phase(
        b, row, p, scores_ptr, hist_ptr, rowinfo_ptr, counts_ptr, seq_lens_ptr, sel_ptr, sel_slot_ptr,
        req_to_token_ptr, req_idx_ptr, heavy_k, threshold,
        stride_sb, stride_sr, stride_hp, stride_hb, stride_hr, stride_rib, stride_rir,
        stride_cb, stride_cr, stride_selb, stride_selr, stride_rt,
        PHASE, NUM_PROGS, BLOCK_N, ATOMIC_HIST, LOOP_STAGES, MAX_PROGS, PREFETCH)


@triton.jit(noinline=True)
def _attn_item(
    b, row, split, q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, req_idx_ptr, seq_lens_ptr,
    sel_ptr, part_o_ptr, part_lse_ptr, count_ptr, out_ptr, sm_scale, heavy_k, threshold,
    stride_qb, stride_qh, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_rt, stride_selb,
    stride_selr, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_cb, stride_ob,
    stride_oh, G: tl.constexpr, D: tl.constexpr, PER_HEAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    attn_split(
        b, row, split, q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, req_idx_ptr, seq_lens_ptr,
        sel_ptr, part_o_ptr, part_lse_ptr, count_ptr, out_ptr, sm_scale, heavy_k, threshold,
        stride_qb, stride_qh, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_rt, stride_selb,
        stride_selr, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_cb, stride_ob,
        stride_oh, G, D, PER_HEAD, True, NUM_SPLITS, BLOCK_H, BLOCK_N, BLOCK_D, DOT_F32, True, BLOCK_S)


@triton.jit
def ds_persistent_kernel(
    items_ptr, num_items, sync_ptr,
    q_ptr, label_ptr, channels_ptr, scale_ptr, k_cache_ptr, v_cache_ptr,
    req_to_token_ptr, req_idx_ptr, seq_lens_ptr,
    scores_ptr, hist_ptr, rowinfo_ptr, counts_ptr, sel_ptr, sel_slot_ptr,
    part_o_ptr, part_lse_ptr, split_count_ptr, out_ptr,
    sm_scale, heavy_k, threshold, num_sink, num_recent, batch,
    stride_sync,
    stride_qb, stride_qh, stride_ls, stride_lh, stride_ch, stride_rt,
    stride_sb, stride_sr, stride_hp, stride_hb, stride_hr, stride_rib, stride_rir,
    stride_cb, stride_cr, stride_selb, stride_selr,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_scb, stride_ob, stride_oh,
    # score (ds_score.score_mma_slice)
    HKV: tl.constexpr, G: tl.constexpr, R: tl.constexpr, MODE: tl.constexpr,
    LABEL_FP8: tl.constexpr, LABEL_KIND: tl.constexpr, SCORE_ITEMS: tl.constexpr,
    SCORE_BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, HKV_P: tl.constexpr, G_P: tl.constexpr,
    SCORE_HIST: tl.constexpr,
    # select (ds_topk.select_phase)
    HIST_ITEMS: tl.constexpr, HIST_BLOCK_N: tl.constexpr, SEL_ITEMS: tl.constexpr,
    SEL_BLOCK_N: tl.constexpr, ATOMIC_HIST: tl.constexpr, SEL_LOOP_STAGES: tl.constexpr,
    COMPACT_LOOP_STAGES: tl.constexpr, MAX_PROGS: tl.constexpr, PREFETCH2: tl.constexpr,
    PREFETCH3: tl.constexpr,
    # attention (decode_attn.attn_split)
    D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, ATTN_BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ROWS_MAX: tl.constexpr, SYNC_BLOCK: tl.constexpr, DOT_F32: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,
):
    PER_HEAD: tl.constexpr = MODE == 0
    ticket_ptr = sync_ptr + 1 + 3 * ROWS_MAX
    stall_ptr = ticket_ptr + 2  # not zeroed below: the host reads and clears it
    t = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
    kind, b, row, p = _item(items_ptr, t, num_items)
    while t < num_items:
        # The next ticket and its item now, so their latency overlaps this item (still
        # deadlock-free: that item waits only for earlier ones, and this program takes it up
        # after this one).
        t_next = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
        kind_next, b_next, row_next, p_next = _item(items_ptr, t_next, num_items)
        # Entry b's counters: [score, hist1[ROWS_MAX], hist2[ROWS_MAX], compact[ROWS_MAX]]
        sb = sync_ptr + b * stride_sync
        stall_info = (t, kind, b, row, p)
        if kind == 0:  # SCORE
            _score_item(
                b, p, q_ptr, label_ptr, channels_ptr, scale_ptr, req_to_token_ptr, req_idx_ptr,
                seq_lens_ptr, scores_ptr, sm_scale, heavy_k, threshold, num_sink, num_recent,
                stride_qb, stride_qh, stride_ls, stride_lh, stride_ch, stride_rt, stride_sb, stride_sr,
                hist_ptr, stride_hb, stride_hr,
                HKV, G, R, MODE, LABEL_FP8, LABEL_KIND, SCORE_ITEMS, SCORE_BLOCK_N, BLOCK_C, HKV_P,
                G_P, DOT_F32, SCORE_HIST)
            _signal(sb)
        elif kind == 4:  # ATTN, after the row's COMPACTs
            _wait(sb + 1 + 2 * ROWS_MAX + row, SEL_ITEMS, stall_info, stall_ptr, SPIN_LIMIT)
            _attn_item(
                b, row, p, q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, req_idx_ptr,
                seq_lens_ptr, sel_slot_ptr, part_o_ptr, part_lse_ptr, split_count_ptr, out_ptr,
                sm_scale, heavy_k, threshold, stride_qb, stride_qh,
                stride_kcs, stride_kch, stride_vcs, stride_vch, stride_rt, stride_selb, stride_selr,
                stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_scb, stride_ob,
                stride_oh, G, D, PER_HEAD, NUM_SPLITS, BLOCK_H, ATTN_BLOCK_N, BLOCK_D, DOT_F32, BLOCK_S)
        else:
            if kind == 1:  # HIST1, after the entry's SCOREs
                _wait(sb, SCORE_ITEMS, stall_info, stall_ptr, SPIN_LIMIT)
                _select_item(
                    b, row, p, scores_ptr, hist_ptr, rowinfo_ptr, counts_ptr, seq_lens_ptr, sel_ptr,
                    sel_slot_ptr, req_to_token_ptr, req_idx_ptr, heavy_k, threshold,
                    stride_sb, stride_sr, stride_hp, stride_hb, stride_hr, stride_rib, stride_rir,
                    stride_cb, stride_cr, stride_selb, stride_selr, stride_rt,
                    1, HIST_ITEMS, HIST_BLOCK_N, ATOMIC_HIST, SEL_LOOP_STAGES, MAX_PROGS, False)
            elif kind == 2:  # HIST2, after the row's HIST1s (or the entry's SCOREs, which made hist[0])
                if SCORE_HIST:
                    _wait(sb, SCORE_ITEMS, stall_info, stall_ptr, SPIN_LIMIT)
                else:
                    _wait(sb + 1 + row, HIST_ITEMS, stall_info, stall_ptr, SPIN_LIMIT)
                _select_item(
                    b, row, p, scores_ptr, hist_ptr, rowinfo_ptr, counts_ptr, seq_lens_ptr, sel_ptr,
                    sel_slot_ptr, req_to_token_ptr, req_idx_ptr, heavy_k, threshold,
                    stride_sb, stride_sr, stride_hp, stride_hb, stride_hr, stride_rib, stride_rir,
                    stride_cb, stride_cr, stride_selb, stride_selr, stride_rt,
                    2, SEL_ITEMS, SEL_BLOCK_N, ATOMIC_HIST, SEL_LOOP_STAGES, MAX_PROGS, PREFETCH2)
            else:  # COMPACT, after the row's HIST2s
                _wait(sb + 1 + ROWS_MAX + row, SEL_ITEMS, stall_info, stall_ptr, SPIN_LIMIT)
                _select_item(
                    b, row, p, scores_ptr, hist_ptr, rowinfo_ptr, counts_ptr, seq_lens_ptr, sel_ptr,
                    sel_slot_ptr, req_to_token_ptr, req_idx_ptr, heavy_k, threshold,
                    stride_sb, stride_sr, stride_hp, stride_hb, stride_hr, stride_rib, stride_rir,
                    stride_cb, stride_cr, stride_selb, stride_selr, stride_rt,
                    3, SEL_ITEMS, SEL_BLOCK_N, ATOMIC_HIST, COMPACT_LOOP_STAGES, MAX_PROGS, PREFETCH3)
            _signal(sb + 1 + (kind - 1) * ROWS_MAX + row)
        # The kinds' shared-memory scratch overlaps (one item at a time per program): no warp
        # starts the next item while another may still use this one's.
        tl.debug_barrier()
        t, kind, b, row, p = t_next, kind_next, b_next, row_next, p_next

    # The last program out zeroes every counter (the ticket and this count too) for the next call.
    done = tl.atomic_add(ticket_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        cols = tl.arange(0, SYNC_BLOCK)
        for bb in range(0, batch):
            tl.store(sync_ptr + bb * stride_sync + cols, tl.zeros([SYNC_BLOCK], tl.int32),
                     mask=cols < 3 * ROWS_MAX + 3)
