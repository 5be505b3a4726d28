"""Triton kernel for Double Sparsity stage 1: label scoring, every KV head of a token in one program.

A token's labels for all KV heads are one contiguous row of the label pool (``[slot, Hkv, r]``), so
a program that scores every head at once streams whole rows with 16-byte loads, uses every byte of
each sector it fetches, and looks each slot up in ``req_to_token`` once instead of once per head.

All heads' products are one matrix product on the tensor cores:

    S[n, col] = sum_c L[n, c] * Q[c, col],    c = kvh * R + j,    col = kvh * G_P + g

with ``Q[c, col] = scale * q[head(col), channels[kvh, j]]`` where the channel row and the column
belong to the same KV head, and zero elsewhere (G_P, HKV_P: the group size and KV head count padded
to powers of two). q is split into a bf16 high part and a bf16 low part (q = hi + lo to about
2^-16 relative), and bf16 and fp8 labels are exact in bf16, so two bf16 products give the scores to
about fp32 accuracy before they are rounded to fp16. The group modes then reduce S over each KV
head's G_P columns (sum, or max with the padding columns at -inf).
"""

import triton
import triton.language as tl

from .ds_common import FP16_MAX, sparse_len, split_range


@triton.jit
def _slots(rt_row, offs, end):
    return tl.load(rt_row + offs, mask=offs < end, other=0).to(tl.int64)


@triton.jit
def _labels(label_ptr, slot, rmask, lab_off, cmask, stride_ls, FULL: tl.constexpr):
    # [BLOCK_N, BLOCK_C] labels of the slots' rows; masked rows fetch nothing. A mask along the
    # channels would cut the 16-byte vectors, so only a partial last head-block gets one.
    ptrs = label_ptr + slot[:, None] * stride_ls + lab_off[None, :]
    if FULL:
        return tl.load(ptrs, mask=rmask[:, None], other=0.0)
    return tl.load(ptrs, mask=rmask[:, None] & cmask[None, :], other=0.0)


@triton.jit
def score_mma_kernel(
    q_ptr, label_ptr, channels_ptr, scale_ptr,
    req_to_token_ptr, req_idx_ptr, seq_lens_ptr,
    scores_ptr,
    sm_scale, k_ptr, num_sink, num_recent,
    stride_qb, stride_qh, stride_ls, stride_lh, stride_ch, stride_rt,
    stride_sb, stride_sr,
    HKV: tl.constexpr, G: tl.constexpr, R: tl.constexpr, MODE: tl.constexpr,
    LABEL_FP8: tl.constexpr, LABEL_KIND: tl.constexpr, NUM_PROGS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, HKV_P: tl.constexpr, G_P: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # One program: (batch entry, slice of positions), all KV heads. MODE 0 = per query head (one
    # score row per query head), 1 = group sum, 2 = group max (one row per KV head).
    # LABEL_KIND: 0 = bf16 or fp8 labels (bf16 products), 1 = fp16 (fp16 products), 2 = fp32.
    score_mma_slice(
        tl.program_id(0), tl.program_id(1), q_ptr, label_ptr, channels_ptr, scale_ptr,
        req_to_token_ptr, req_idx_ptr, seq_lens_ptr, scores_ptr,
        sm_scale, k_ptr, num_sink, num_recent,
        stride_qb, stride_qh, stride_ls, stride_lh, stride_ch, stride_rt, stride_sb, stride_sr,
        HKV, G, R, MODE, LABEL_FP8, LABEL_KIND, NUM_PROGS, BLOCK_N, BLOCK_C, HKV_P, G_P, DOT_F32)


@triton.jit
def score_mma_slice(
    b, p, q_ptr, label_ptr, channels_ptr, scale_ptr,
    req_to_token_ptr, req_idx_ptr, seq_lens_ptr, scores_ptr,
    sm_scale, k_ptr, num_sink, num_recent,
    stride_qb, stride_qh, stride_ls, stride_lh, stride_ch, stride_rt, stride_sb, stride_sr,
    HKV: tl.constexpr, G: tl.constexpr, R: tl.constexpr, MODE: tl.constexpr,
    LABEL_FP8: tl.constexpr, LABEL_KIND: tl.constexpr, NUM_PROGS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, HKV_P: tl.constexpr, G_P: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # Slice p of NUM_PROGS of batch entry b's positions, every KV head (score_mma_kernel's body).
    seq_len = tl.load(seq_lens_ptr + b)
    n = sparse_len(seq_len, tl.load(k_ptr + b))  # 0 for a dense request

    # Q: [BLOCK_C, HKV_P * G_P], block-diagonal over KV heads.
    c = tl.arange(0, BLOCK_C)
    cmask = c < HKV * R
    c_kvh = c // R
    ch = tl.load(channels_ptr + c_kvh * stride_ch + c % R, mask=cmask, other=0)
    col = tl.arange(0, HKV_P * G_P)
    col_kvh = col // G_P
    col_g = col % G_P
    colmask = (col_g < G) & (col_kvh < HKV)
    head = col_kvh * G + col_g
    scale = sm_scale
    if LABEL_FP8:
        scale = scale * tl.load(scale_ptr)
    qmask = cmask[:, None] & colmask[None, :] & (c_kvh[:, None] == col_kvh[None, :])
    qv = tl.load(q_ptr + b * stride_qb + head[None, :] * stride_qh + ch[:, None], mask=qmask,
                 other=0.0).to(tl.float32) * scale
    if LABEL_KIND == 1:
        q_hi = qv.to(tl.float16)
    else:
        q_hi = qv.to(tl.bfloat16)
    q_lo = (qv - q_hi.to(tl.float32)).to(q_hi.dtype)

    # Label addresses: channel j of KV head kvh of a slot (contiguous within a head, so loads are
    # 16 bytes wide whenever a head's r labels span 16 bytes or more).
    lab_off = c_kvh * stride_lh + c % R
    kv = tl.arange(0, HKV_P)
    gvalid = tl.arange(0, G_P) < G
    rt_row = req_to_token_ptr + tl.load(req_idx_ptr + b).to(tl.int64) * stride_rt
    srow = scores_ptr + b * stride_sb
    start, end = split_range(n, p, NUM_PROGS, BLOCK_N)
    ar = tl.arange(0, BLOCK_N)
    # Software-pipelined by hand: while a tile is scored, the next tile's labels and the slots of
    # the one after are in flight. (Triton's pipeliner waits for the index load and the gather it
    # feeds together, which leaves one tile in flight and none overlapping the math.)
    # (Two tiles of labels in flight, for more registers, measured slower on an H200: 75.5 vs
    # 66.6 us for the whole DS step at 64K x 3.)
    FULL: tl.constexpr = BLOCK_C == HKV * R
    slot_after = _slots(rt_row, start + BLOCK_N + ar, end)
    lab_next = _labels(label_ptr, _slots(rt_row, start + ar, end), start + ar < end, lab_off, cmask,
                       stride_ls, FULL)
    # num_stages=1: pipelined by hand (see above).
    for t in tl.range(start, end, BLOCK_N, num_stages=1):
        offs = t + ar
        nmask = offs < end
        lab = lab_next
        lab_next = _labels(label_ptr, slot_after, offs + BLOCK_N < end, lab_off, cmask, stride_ls, FULL)
        slot_after = _slots(rt_row, offs + 2 * BLOCK_N, end)
        if DOT_F32:
            # The interpreter: plain fp32 products (its low-precision dots are not reliable).
            s = tl.dot(lab.to(tl.float32), qv)
        elif LABEL_KIND == 2:
            s = tl.dot(lab, qv, input_precision="ieee")
        else:
            lab16 = lab.to(q_hi.dtype)
            s = tl.dot(lab16, q_hi)
            s = tl.dot(lab16, q_lo, s)
        keep = (offs < num_sink) | (offs >= seq_len - num_recent)
        if MODE == 0:
            v = tl.where(keep[:, None], FP16_MAX, tl.minimum(tl.maximum(s, -FP16_MAX), FP16_MAX))
            tl.store(srow + head[None, :] * stride_sr + offs[:, None], v.to(tl.float16),
                     mask=nmask[:, None] & colmask[None, :])
        else:
            s3 = tl.reshape(s, [BLOCK_N, HKV_P, G_P])
            if MODE == 2:
                red = tl.max(tl.where(gvalid[None, None, :], s3, float("-inf")), 2)
            else:
                red = tl.sum(s3, 2)  # padding columns of Q are zero
            v = tl.where(keep[:, None], FP16_MAX, tl.minimum(tl.maximum(red, -FP16_MAX), FP16_MAX))
            v16 = v.to(tl.float16)
            ok = nmask[:, None] & (kv < HKV)[None, :]
            tl.store(srow + kv[None, :] * stride_sr + offs[:, None], v16, mask=ok)
