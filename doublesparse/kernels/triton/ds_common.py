"""Triton helpers shared by the Double Sparsity score kernels (ds_score.py, ds_score_rows.py) and
the top-k select (ds_select.py): the fp16 score keys, score-row block loads, a program's slice of
a row, and the radix digit search.
"""

import triton
import triton.language as tl

FP16_MAX = tl.constexpr(65504.0)


@triton.jit
def key16(s16):
    # Order-preserving map of fp16 bits to [0, 65535]: flip all bits of negatives, set the sign bit
    # of positives.
    b = s16.to(tl.int16, bitcast=True).to(tl.int32)
    return tl.where(b < 0, ~b, b | 0x8000) & 0xFFFF


@triton.jit
def load_block(row_ptr, offs, BLOCK_N: tl.constexpr):
    # Unmasked, so Triton vectorizes it: score rows are padded by DecodeWorkspace.SCORE_PAD, and
    # callers mask what lies past their range. offs starts at a multiple of BLOCK_N.
    return tl.load(row_ptr + tl.max_contiguous(tl.multiple_of(offs, BLOCK_N), BLOCK_N))


@triton.jit
def sparse_len(seq_len, k):
    # Positions this request contributes to selection: all of them if it decodes sparsely (the
    # rule of reference.is_sparse: its length exceeds its own budget k), else none.
    return tl.where(seq_len > k, seq_len, 0)


@triton.jit
def split_range(n, p, NUM_PROGS: tl.constexpr, BLOCK_N: tl.constexpr):
    per = tl.cdiv(tl.cdiv(n, NUM_PROGS), BLOCK_N) * BLOCK_N
    start = p * per
    return start, tl.minimum(start + per, n)


@triton.jit
def threshold_digit(h, need):
    # h: [256] counts. Largest digit d with count(keys with digit >= d) >= need, and the count of
    # keys strictly above d.
    idx = tl.arange(0, 256)
    total = tl.sum(h, 0)
    ge = total - tl.cumsum(h, 0) + h
    digit = tl.max(tl.where(ge >= need, idx, -1), 0)
    above = tl.sum(tl.where(idx > digit, h, 0), 0)
    return digit, above
