"""Double Sparsity with q and K rotated over all D (attention/k_rotation.py) while the labels and
the label scores stay unrotated: ``store_kv``'s ``k_label`` (the labels' source) and
``ds_decode``'s ``q_label`` (the score stage's query). The selection is the unrotated one, the
attention reads the rotated q and K; on the PyTorch path and the Triton path (interpreter on a
CPU), at awkward sizes (9 / 3 heads, an odd batch, a request shorter than k)."""

import dataclasses

import pytest
import torch

from conftest import DEVICE
from kernel_utils import TOL, budgets, expected_output, make_case, make_ws, ref, rel_err
from doublesparse.attention import k_rotation
from doublesparse.kernels import ops
from doublesparse.kernels.ops import DSDecodeArgs
from doublesparse.kernels.triton import ds_launch

E4M3 = torch.float8_e4m3fn
SEQ, HQ, HKV, D, R, K = [5, 260, 77], 9, 3, 64, 8, 40      # request 0 decodes densely (5 < k)


def _rotated(c, kv_dtype=None):
    """(the case with q and its K pool rotated over all D (fp8 pools: then quantized at scale 1)
    and its labels unchanged, the rotation [Hkv, D, D])."""
    rot = k_rotation.rotation_matrices(1, HKV, D)[0].to(c.q.device)
    qr, kr = k_rotation.rotate(c.q.float(), c.k_cache.float(), rot)
    one = torch.ones(1, device=c.q.device)
    kc = kr.to(c.k_cache.dtype) if kv_dtype is None else ref.quantize_kv(kr, kv_dtype, one)
    vc = c.v_cache if kv_dtype is None else ref.quantize_kv(c.v_cache.float(), kv_dtype, one)
    return dataclasses.replace(c, q=qr.to(c.q.dtype), k_cache=kc, v_cache=vc), rot


def _case(dtype=torch.float32):
    return make_case(SEQ, HQ, HKV, D, r=R, dtype=dtype, device=DEVICE, seed=21)


def _selection(c, q_label, ks, mode):
    """The reference's selection of ``q_label`` on the case's labels: positions [B, R, K]."""
    sc = ref.label_scores_ref(q_label, c.label_cache, c.label_scale, c.channels, c.req_to_token, c.req_idx,
                              c.seq_lens, mode, c.sm_scale)
    return ref.topk_ref(ref.force_keep(sc, c.seq_lens, 1, 2), K) if mode else None


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_store_takes_labels_from_k_label(impl):
    """K goes to the pool rotated (and quantized), the label from the unrotated k: the labels,
    and so every label score, equal an unrotated store's."""
    g = torch.Generator().manual_seed(3)
    n, S = 7, 19
    k = torch.randn(n, HKV, D, generator=g).to(DEVICE)
    v = torch.randn(n, HKV, D, generator=g).to(DEVICE)
    slots = (torch.randperm(S - 1, generator=g)[:n] + 1).int().to(DEVICE)
    ch = torch.stack([torch.randperm(D, generator=g)[:R] for _ in range(HKV)]).int().to(DEVICE)
    rot = k_rotation.rotation_matrices(1, HKV, D)[0].to(DEVICE)
    _, kr = k_rotation.rotate(torch.zeros(1, HQ, D, device=DEVICE), k, rot)
    one = torch.ones(1, device=DEVICE)
    kc, vc = (torch.zeros(S, HKV, D, dtype=E4M3, device=DEVICE) for _ in range(2))
    lab = torch.zeros(S, HKV, R, dtype=torch.bfloat16, device=DEVICE)
    ops.store_kv(kc, vc, kr, v, slots, lab, None, ch, one, one, impl=impl, k_label=k)
    s = slots.long()
    assert torch.equal(kc[s].view(torch.uint8), ref.quantize_kv(kr, E4M3, one).view(torch.uint8))
    plain = [torch.zeros_like(t) for t in (kc, vc, lab)]
    ops.store_kv(plain[0], plain[1], k, v, slots, plain[2], None, ch, one, one, impl=impl)
    assert torch.equal(lab, plain[2])
    assert torch.equal(vc.view(torch.uint8), plain[1].view(torch.uint8))
    # without k_label the label is the rotated k's
    lab2 = torch.zeros_like(lab)
    ops.store_kv(kc, vc, kr, v, slots, lab2, None, ch, one, one, impl=impl)
    assert not torch.equal(lab2[s], lab[s])
    with pytest.raises(ValueError, match="k_label"):
        ops.store_kv(kc, vc, kr, v, slots, lab, None, ch, one, one, impl=impl, k_label=k[:2])


@pytest.mark.parametrize("mode", ["group_max", "per_head", "layer"])
def test_torch_path_selects_with_the_unrotated_q(mode):
    """Over a float32 pool holding the rotated K, ds_decode(q R, ..., q_label=q) equals the
    unrotated decode (the same selection, every score unchanged by R); over an fp8 pool it is the
    attention of q R, read from the rotated fp8 K, over the unrotated q's selection."""
    c = _case()
    ks = budgets(c, K)
    args = DSDecodeArgs(ks, K, mode, 1, 2)
    want = ops.ds_decode(*c.args(), c.sm_scale, args, impl="torch")
    cr, _ = _rotated(c)
    got = ops.ds_decode(*cr.args(), cr.sm_scale, args, impl="torch", q_label=c.q)
    assert rel_err(got, want) < TOL[torch.float32]
    # the rotated q on unrotated labels selects other tokens
    assert rel_err(ops.ds_decode(*cr.args(), cr.sm_scale, args, impl="torch"), want) > 10 * TOL[torch.float32]
    c8, _ = _rotated(c, E4M3)
    one = torch.ones(1, device=DEVICE)
    got8 = ops.ds_decode(*c8.args(), c8.sm_scale, args, impl="torch", q_label=c.q, k_scale=one, v_scale=one)
    deq = dataclasses.replace(c8, k_cache=ref.dequant_kv(c8.k_cache, one), v_cache=ref.dequant_kv(c8.v_cache, one))
    exp = expected_output(deq, _selection(c, c.q, ks, mode), ks, mode)
    assert rel_err(got8, exp) < TOL[torch.float32]


@pytest.mark.parametrize("mode", ["group_max", "layer"])
def test_triton_path_selects_with_the_unrotated_q(mode):
    """The Triton launches: the score stage reads q_label (the selection equals the unrotated
    case's, entry for entry), the attention reads the rotated q over the rotated fp8 K."""
    c = _case(torch.bfloat16)
    ks = budgets(c, K)
    args = DSDecodeArgs(ks, K, mode, 1, 2)
    c8, _ = _rotated(c, E4M3)
    one = torch.ones(1, device=DEVICE)
    layer = mode == "layer"
    out = torch.full_like(c.q, float("nan"))
    if layer:
        ws = make_ws(c8, k_max=K, layer_select=True)
        ops.ds_decode(*c8.args(), c8.sm_scale, args, ws=ws, out=out, impl="triton", q_label=c.q, k_scale=one,
                      v_scale=one)
        sel = ws.layer.sel[:, :1]
        ws0 = make_ws(c, k_max=K, layer_select=True)
        ops.ds_decode(*c.args(), c.sm_scale, args, ws=ws0, impl="triton")
        sel0 = ws0.layer.sel[:, :1]
    else:
        ws = make_ws(c8, k_max=K)
        _, sel = ds_launch.ds_decode(*c8.args(), c8.sm_scale, args, ws=ws, out=out, return_sel=True, q_label=c.q,
                                     k_scale=one, v_scale=one)
        _, sel0 = ds_launch.ds_decode(*c.args(), c.sm_scale, args, ws=make_ws(c, k_max=K), return_sel=True)
    assert not out.isnan().any()
    for b, n in enumerate(SEQ):
        if n > K:   # the same tokens (the select's order is the scores' order: the same)
            assert torch.equal(sel[b, :, :K].sort(-1).values, sel0[b, :, :K].sort(-1).values)
    rows = sel.expand(-1, HKV, -1) if layer else sel
    exp = expected_output(dataclasses.replace(c8, k_cache=ref.dequant_kv(c8.k_cache, one),
                                              v_cache=ref.dequant_kv(c8.v_cache, one)), rows, ks, "group_max")
    assert rel_err(out, exp) < TOL[torch.bfloat16]
    # the PyTorch path agrees
    got = ops.ds_decode(*c8.args(), c8.sm_scale, args, impl="torch", q_label=c.q, k_scale=one, v_scale=one)
    assert rel_err(got, exp) < TOL[torch.bfloat16]
    with pytest.raises(ValueError, match="q_label"):
        ops.ds_decode(*c8.args(), c8.sm_scale, args, ws=ws, impl="triton", q_label=c.q[:, :3].contiguous(),
                      k_scale=one, v_scale=one)
