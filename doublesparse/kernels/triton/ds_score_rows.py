"""Triton kernel for Double Sparsity stage 1 with one KV head per program (``score_impl="rows"``).

Selection (ds_select.py) is an exact radix select over 16-bit keys of the fp16 scores written here.
(Making the select's high-byte histogram here too, to spare its first phase, measured slower: the
histogram's barriers and ballots slowed the label stream; the CUDA score does it instead.)

Loops use ``tl.range(num_stages=...)``: that annotation makes Triton pipeline every load of the
loop (cp.async), the label gather included; a plain ``range`` pipelines only loads feeding a dot.
"""

import triton
import triton.language as tl

from .ds_common import FP16_MAX, sparse_len, split_range


@triton.jit
def _emit_scores(s, offs, nmask, seq_len, num_sink, num_recent, out_ptr):
    # Store one row of scores as fp16 (sink and recent positions at the maximum).
    keep = (offs < num_sink) | (offs >= seq_len - num_recent)
    s = tl.where(keep, FP16_MAX, tl.minimum(tl.maximum(s, -FP16_MAX), FP16_MAX))
    tl.store(out_ptr + offs, s.to(tl.float16), mask=nmask)


@triton.jit
def _q_at(q_row, i: tl.constexpr, stride_qh, rmask, scale, G: tl.constexpr):
    # Query head i of the group at the heavy channels, fp32, scaled; zeros past the group.
    return tl.load(q_row + i * stride_qh, mask=rmask & (i < G), other=0.0).to(tl.float32) * scale


@triton.jit
def _pick(i: tl.constexpr, q_row, stride_qh, rmask, scale, G: tl.constexpr, q0, q1, q2, q3, q4, q5, q6, q7):
    # Compile-time choice among the hoisted rows (i is a static_range index).
    if G > 8:
        out = _q_at(q_row, i, stride_qh, rmask, scale, G)
    elif i == 0:
        out = q0
    elif i == 1:
        out = q1
    elif i == 2:
        out = q2
    elif i == 3:
        out = q3
    elif i == 4:
        out = q4
    elif i == 5:
        out = q5
    elif i == 6:
        out = q6
    else:
        out = q7
    return out


@triton.jit
def score_kernel(
    q_ptr, label_ptr, channels_ptr, scale_ptr,
    req_to_token_ptr, req_idx_ptr, seq_lens_ptr,
    scores_ptr,
    sm_scale, k_ptr, num_sink, num_recent,
    stride_qb, stride_qh, stride_ls, stride_lh, stride_ch, stride_rt,
    stride_sb, stride_sr,
    G: tl.constexpr, R: tl.constexpr, MODE: tl.constexpr, LABEL_FP8: tl.constexpr,
    NUM_PROGS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    # One program: (batch entry, KV head, slice of positions). MODE 0 = per query head (writes the
    # G score rows of the group), 1 = group sum, 2 = group max (one row per KV head).
    # Everything stays 2-D [BLOCK_N, BLOCK_R] in one layout: a 3-D head x token x channel product
    # made Triton shuffle the label tile through shared memory on every iteration.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    p = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    n = sparse_len(seq_len, tl.load(k_ptr + b))  # 0 for a dense request

    r = tl.arange(0, BLOCK_R)
    rmask = r < R
    ch = tl.load(channels_ptr + kvh * stride_ch + r, mask=rmask, other=0)
    scale = sm_scale
    if LABEL_FP8:
        scale = scale * tl.load(scale_ptr)
    q_row = q_ptr + b * stride_qb + kvh * G * stride_qh + ch

    # The group's query rows, loaded (and scaled) once: loads inside the loop are re-issued every
    # iteration (Triton cannot prove the score stores don't alias them). Groups above 8 reload.
    q0 = _q_at(q_row, 0, stride_qh, rmask, scale, G)
    q1 = _q_at(q_row, 1, stride_qh, rmask, scale, G)
    q2 = _q_at(q_row, 2, stride_qh, rmask, scale, G)
    q3 = _q_at(q_row, 3, stride_qh, rmask, scale, G)
    q4 = _q_at(q_row, 4, stride_qh, rmask, scale, G)
    q5 = _q_at(q_row, 5, stride_qh, rmask, scale, G)
    q6 = _q_at(q_row, 6, stride_qh, rmask, scale, G)
    q7 = _q_at(q_row, 7, stride_qh, rmask, scale, G)

    req = tl.load(req_idx_ptr + b).to(tl.int64)
    start, end = split_range(n, p, NUM_PROGS, BLOCK_N)
    for t in tl.range(start, end, BLOCK_N, num_stages=LOOP_STAGES):
        offs = t + tl.arange(0, BLOCK_N)
        nmask = offs < end
        slot = tl.load(req_to_token_ptr + req * stride_rt + offs, mask=nmask, other=0).to(tl.int64)
        lab_ptrs = label_ptr + slot[:, None] * stride_ls + kvh * stride_lh + r[None, :]
        if BLOCK_R == R:
            # A channel mask, even an all-true one, hides the row's contiguity from Triton and
            # turns each label row into 16 scalar loads (measured on an H200: 2x the instructions).
            lab = tl.load(lab_ptrs, mask=nmask[:, None], other=0.0).to(tl.float32)
        else:
            lab = tl.load(lab_ptrs, mask=nmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
        if MODE == 0:
            for i in tl.static_range(G):
                qi = _pick(i, q_row, stride_qh, rmask, scale, G, q0, q1, q2, q3, q4, q5, q6, q7)
                s_i = tl.sum(lab * qi[None, :], 1)
                _emit_scores(s_i, offs, nmask, seq_len, num_sink, num_recent,
                             scores_ptr + b * stride_sb + (kvh * G + i) * stride_sr)
        else:
            s = tl.full([BLOCK_N], float("-inf"), tl.float32) if MODE == 2 else tl.zeros([BLOCK_N], tl.float32)
            for i in tl.static_range(G):
                qi = _pick(i, q_row, stride_qh, rmask, scale, G, q0, q1, q2, q3, q4, q5, q6, q7)
                s_i = tl.sum(lab * qi[None, :], 1)
                s = tl.maximum(s, s_i) if MODE == 2 else s + s_i
            _emit_scores(s, offs, nmask, seq_len, num_sink, num_recent,
                         scores_ptr + b * stride_sb + kvh * stride_sr)
