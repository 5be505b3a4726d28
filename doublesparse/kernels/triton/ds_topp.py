"""Triton kernels of the top-p token budget, run between the top-k select and the sparse
attention (two launches, static grids, no host sync; the CUDA score and select are unchanged).

Per selection row (b, row) of a request that decodes sparsely, with k = its budget (capped at
the workspace's k_max) and the select's k positions in ``sel``:

1. ``topp_mass_kernel``, grid (B, rows, P): program p's slice of the row's fp16 scores, the
   forced sink/recent positions left out (their stored scores are fp16's maximum, not their
   label scores): the running maximum and sum of ``2^(s log2 e - max)`` -> ``topp_part[b, row, p]``.
2. ``topp_keep_kernel``, grid (B, rows): the row's max and softmax denominator Z from the
   partials; the whole selection (k <= K_P entries, one block in registers) with each entry's
   key and weight; a 16-step binary search over the 16-bit keys for tau, the largest key at which
   the entries with key >= tau weigh at least ``top_p * Z`` and number at least ``k_min`` with
   the forced ones (both counts fall as tau rises, so their conjunction is monotone; where no key
   satisfies it, tau = 0 keeps everything). The kept entries' cache slots are written, in
   selection order, to the front of ``topp_slot[b, row]`` and their number to ``row_k[b, row]``
   (a dense request's row gets its length). The attention then reads ``row_k`` entries.

Equal to ``reference.topp_keep_ref`` up to float32 summation order (a weight sum within rounding
of ``top_p * Z`` can fall either way).
"""

import triton
import triton.language as tl

from .ds_common import key16, load_block, sparse_len, split_range

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def topp_mass_kernel(
    scores_ptr, seq_lens_ptr, k_ptr, part_ptr, num_sink, num_recent,
    stride_sb, stride_sr, stride_pb, stride_pr,
    NUM_PROGS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.program_id(1)
    p = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    n = sparse_len(seq_len, tl.load(k_ptr + b))
    start, end = split_range(n, p, NUM_PROGS, BLOCK_N)
    srow = scores_ptr + b * stride_sb + row * stride_sr
    lo = num_sink
    hi = n - num_recent
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for t in range(start, end, BLOCK_N):
        offs = t + tl.arange(0, BLOCK_N)
        ok = (offs < end) & (offs >= lo) & (offs < hi)
        s = tl.where(ok, load_block(srow, offs, BLOCK_N).to(tl.float32) * LOG2E, float("-inf"))
        # Elementwise running max and sum (one reduction at the end); a lane that has seen no
        # token keeps max -inf and sum 0 (its rescale uses 0 so that -inf - -inf never occurs).
        m_new = tl.maximum(m, s)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.exp2(m - safe) + tl.exp2(s - safe)
        m = m_new
    mx = tl.max(m, 0)
    safe = tl.where(mx == float("-inf"), 0.0, mx)
    total = tl.sum(acc * tl.exp2(m - safe), 0)
    out = part_ptr + b * stride_pb + row * stride_pr + p * 2
    tl.store(out, mx)
    tl.store(out + 1, total)


@triton.jit
def topp_keep_kernel(
    scores_ptr, seq_lens_ptr, k_ptr, part_ptr, sel_ptr, sel_slot_ptr, out_slot_ptr, row_k_ptr,
    k_max, top_p, k_min, num_sink, num_recent,
    stride_sb, stride_sr, stride_pb, stride_pr, stride_selb, stride_selr, stride_rkb,
    NUM_PROGS: tl.constexpr, P_P: tl.constexpr, K_P: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    k = tl.load(k_ptr + b)
    sparse = seq_len > k
    k = tl.minimum(k, k_max)

    pp = tl.arange(0, P_P)
    part = part_ptr + b * stride_pb + row * stride_pr + pp * 2
    pm = tl.load(part, mask=pp < NUM_PROGS, other=float("-inf"))
    pl = tl.load(part + 1, mask=pp < NUM_PROGS, other=0.0)
    mx = tl.max(pm, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    z = tl.sum(pl * tl.exp2(pm - mx), 0)

    i = tl.arange(0, K_P)
    valid = (i < k) & sparse
    sel_off = b * stride_selb + row * stride_selr
    pos = tl.load(sel_ptr + sel_off + i, mask=valid, other=0)
    srow = scores_ptr + b * stride_sb + row * stride_sr
    s16 = tl.load(srow + pos, mask=valid, other=0.0)
    forced = valid & ((pos < num_sink) | (pos >= seq_len - num_recent))
    cand = valid & (forced == 0)
    key = tl.where(cand, key16(s16), -1)
    # The forced entries' stored scores (fp16's maximum) would overflow: exponentiate -inf there.
    w = tl.exp2(tl.where(cand, s16.to(tl.float32) * LOG2E - mx, float("-inf")))
    need_mass = top_p * z
    need_count = k_min - tl.sum(forced.to(tl.int32), 0)
    lo = 0
    hi = 65536
    for _ in tl.static_range(16):
        mid = (lo + hi) // 2
        ge = key >= mid
        ok = (tl.sum(tl.where(ge, w, 0.0), 0) >= need_mass) & (tl.sum(ge.to(tl.int32), 0) >= need_count)
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    keep = forced | (cand & (key >= lo))
    slot = tl.load(sel_slot_ptr + sel_off + i, mask=keep, other=0)
    dst = tl.cumsum(keep.to(tl.int32), 0) - 1
    tl.store(out_slot_ptr + sel_off + dst, slot, mask=keep)
    tl.store(row_k_ptr + b * stride_rkb + row, tl.where(sparse, tl.sum(keep.to(tl.int32), 0), seq_len))
