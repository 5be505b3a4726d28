"""The engine's PyTorch decode path (kernels/torch_ops.py) against the float32 references, with a
request's slots consecutive (read as a slice of the pool) and scattered (gathered)."""

import pytest
import torch
from kernel_utils import make_case, ref

from doublesparse.attention.budget import DENSE
from doublesparse.kernels import torch_ops
from doublesparse.kernels.ops import DSDecodeArgs

FP8 = torch.float8_e4m3fn


def _consecutive(c, start=3):
    """The case with every request's positions moved to consecutive slots from ``start`` on
    (its k/v/labels copied along), so the torch path reads slices."""
    r2t = c.req_to_token.clone()
    caches = [c.k_cache.clone(), c.v_cache.clone(), c.label_cache.clone()]
    s = start
    for row, n in zip(c.req_idx.tolist(), c.seq_lens.tolist()):
        old = c.req_to_token[row, :n].long()
        new = torch.arange(s, s + n)
        for dst, src in zip(caches, (c.k_cache, c.v_cache, c.label_cache)):
            dst[new] = src[old]
        r2t[row, :n] = new.int()
        s += n + 2
    args = list(c.args())
    args[1], args[2], args[3], args[6] = caches[0], caches[1], caches[2], r2t
    return args


@pytest.mark.parametrize("mode,label_dtype,layout", [
    ("per_head", torch.bfloat16, "consecutive"), ("group_sum", FP8, "scattered"),
    ("group_max", torch.bfloat16, "scattered"), ("group_max", FP8, "consecutive")])
def test_ds_and_dense_decode_match_reference(mode, label_dtype, layout):
    c = make_case([53, 7, 131], 9, 3, 64, seed=5, label_dtype=label_dtype, dtype=torch.float32,
                  max_ctx=150)
    args = list(c.args()) if layout == "scattered" else _consecutive(c)
    assert args[0].shape[0] == 3
    for ks, sink, recent in (([24, 24, 24], 0, 0), ([37, DENSE, 100], 2, 3), ([5, 6, 131], 1, 1)):
        ks = torch.tensor(ks, dtype=torch.int32)
        out = torch_ops.ds_decode(*args, c.sm_scale, DSDecodeArgs(ks, 131, mode, sink, recent))
        exp = ref.ds_decode_ref(*args, c.sm_scale, ks, mode, sink, recent)
        torch.testing.assert_close(out, exp, rtol=1e-4, atol=1e-4)
    out = torch_ops.dense_decode(*args[:3], *args[6:], c.sm_scale)
    exp = ref.dense_decode_ref(*args[:3], *args[6:], c.sm_scale)
    torch.testing.assert_close(out, exp, rtol=1e-4, atol=1e-4)


def test_token_rows_detects_runs():
    r2t = torch.zeros(3, 10, dtype=torch.int32)
    r2t[1, :6] = torch.arange(4, 10)
    r2t[2, :6] = torch.tensor([4, 5, 7, 6, 8, 9])          # same ends, not a run
    assert torch_ops.token_rows(r2t, 1, 6) == (4, None)
    start, slots = torch_ops.token_rows(r2t, 2, 6)
    assert start is None and slots.tolist() == [4, 5, 7, 6, 8, 9]
    assert torch_ops.token_rows(r2t, 1, 1) == (4, None)
