"""The "layer" selection mode: one top-k per request shared by every head of a layer, over the sum
of all query heads' label scores. The Triton path (kernels/triton/ds_layer.py: a group mode of one
virtual KV head, no kernel of its own) against the references, at awkward sizes; the PyTorch path
against the reference."""

import pytest
import torch

from conftest import DEVICE
from kernel_utils import TOL, budgets, check_selection, make_case, make_ws, rel_err
from doublesparse.kernels import ops
from doublesparse.kernels.ops import DSDecodeArgs
from doublesparse.kernels import reference as ref

FP8 = torch.float8_e4m3fn
CASES = [  # seq_lens, Hq, Hkv, D, r, k
    ([300], 9, 3, 64, 16, 32),
    ([5, 260, 77], 9, 3, 64, 8, 40),      # one short request decodes densely
    ([129, 200, 64], 32, 8, 128, 16, 64),
    ([50, 50], 4, 2, 64, 16, 49),         # k = L - 1
]


def _reference(c, ks, sink=0, recent=0):
    return ref.ds_decode_ref(*c.args(), c.sm_scale, ks, "layer", sink, recent)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("label_dtype", [torch.bfloat16, FP8])
def test_layer_decode_matches_reference(case, label_dtype):
    seq_lens, hq, hkv, d, r, k = case
    if DEVICE == "cpu" and label_dtype == FP8 and d >= 128:
        pytest.skip("interpreter time")
    c = make_case(seq_lens, hq, hkv, d, r=r, label_dtype=label_dtype, device=DEVICE, seed=len(seq_lens) + r)
    ws = make_ws(c, k_max=k + 3, layer_select=True)
    ks = budgets(c, k)
    out = torch.full_like(c.q, float("nan"))
    ops.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(ks, k, "layer", 1, 2), ws=ws, out=out, impl="triton")
    assert not out.isnan().any()
    # the shared row: the layer's scores and their top-k (sink and recent forced)
    check_selection(c, ws.layer, ws.layer.sel, k, "layer", 1, 2)
    exp = ref.sparse_decode_ref(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_idx,
                                ws.layer.sel[:, :1, :k].long(), c.sm_scale)
    sparse = c.seq_lens > k
    assert rel_err(out[sparse], exp[sparse]) < TOL[torch.bfloat16]
    dense = ref.dense_decode_ref(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_idx, c.seq_lens, c.sm_scale)
    assert rel_err(out[~sparse], dense[~sparse]) < TOL[torch.bfloat16] if bool((~sparse).any()) else True


@pytest.mark.parametrize("case", CASES[:3])
def test_layer_torch_path_matches_reference(case):
    seq_lens, hq, hkv, d, r, k = case
    c = make_case(seq_lens, hq, hkv, d, r=r, dtype=torch.float32, seed=5)
    ks = budgets(c, k)
    out = ops.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(ks, k, "layer", 1, 2), impl="torch")
    assert torch.allclose(out.float(), _reference(c, ks, 1, 2), atol=1e-4, rtol=1e-4)


def test_layer_scores_sum_every_head():
    """The layer's score of a token is the sum over every query head of the group modes' terms."""
    c = make_case([40, 33], 6, 3, 32, r=4, dtype=torch.float32, seed=1)
    lay = ref.label_scores_ref(c.q, c.label_cache, c.label_scale, c.channels, c.req_to_token, c.req_idx,
                               c.seq_lens, "layer", c.sm_scale)
    grp = ref.label_scores_ref(c.q, c.label_cache, c.label_scale, c.channels, c.req_to_token, c.req_idx,
                               c.seq_lens, "group_sum", c.sm_scale)
    assert lay.shape[1] == 1
    n = 33
    assert torch.allclose(lay[1, 0, :n], grp[1, :, :n].sum(0), atol=1e-5)


def test_layer_mode_refusals():
    c = make_case([100], 4, 2, 32, r=4, device=DEVICE)
    ks = budgets(c, 16)
    with pytest.raises(ValueError, match="layer_select"):
        ops.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(ks, 16, "layer"), ws=make_ws(c, 16), impl="triton")
    with pytest.raises(ValueError, match="top-p"):
        ops.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(ks, 16, "layer", top_p=0.9),
                      ws=make_ws(c, 16, layer_select=True), impl="triton")
