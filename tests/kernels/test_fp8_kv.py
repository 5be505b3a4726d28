"""fp8 K/V pools (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``): every store quantizes, every reader
dequantizes, against the float32 references, at awkward sizes (9/3 heads, odd batches, lengths off
every block size).

On CPU the Triton kernels run under the interpreter, whose own float32 -> fp8 conversion rounds
wrongly; the store kernels compute the bits themselves there (kernels/triton/kv_quant.py), so stores
are compared bit for bit with torch's ``.to(float8)``. The fused RoPE store rotates with the
interpreter's float math, which may differ from torch's by one bf16 ulp, so its K is allowed one fp8
step.
"""

import dataclasses

import pytest
import torch

from conftest import DEVICE
from kernel_utils import TOL, budgets, expected_output, make_case, make_ws, ref, rel_err
from doublesparse.kernels import ops
from doublesparse.kernels.ops import DSDecodeArgs
from doublesparse.kernels.triton import ds_launch, launch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8S = [E4M3, E5M2]
ULP = {E4M3: 2.0 ** -3, E5M2: 2.0 ** -2}     # relative step of the mantissa
# fp8 rounding of K and V alone moves the attention output by this much against bf16 K/V
FP8_VS_BF16 = {E4M3: 0.08, E5M2: 0.15}


def _scales(ks=0.05, vs=0.02):
    return (torch.tensor([ks], dtype=torch.float32, device=DEVICE),
            torch.tensor([vs], dtype=torch.float32, device=DEVICE))


def fp8_case(c, dtype, ks, vs):
    """The case with its K/V pools quantized to ``dtype`` (as a store writes them)."""
    return dataclasses.replace(c, k_cache=ref.quantize_kv(c.k_cache, dtype, ks),
                               v_cache=ref.quantize_kv(c.v_cache, dtype, vs))


def dequant_case(c, ks, vs):
    """The case with float32 pools holding an fp8 case's values."""
    return dataclasses.replace(c, k_cache=ref.dequant_kv(c.k_cache, ks), v_cache=ref.dequant_kv(c.v_cache, vs))


# ---------------------------------------------------------------- stores
@pytest.mark.parametrize("dtype", FP8S)
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_store_quantizes(dtype, impl):
    g = torch.Generator().manual_seed(5)
    n, hkv, d, r, S = 17, 3, 64, 8, 31
    k = (torch.randn(n, hkv, d, generator=g) * 3).bfloat16()
    v = torch.randn(n, hkv, d, generator=g).bfloat16()
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, -0.0])        # clamped to the format's max; signed zeros
    v[1, 2, :3] = torch.tensor([1e-6, 3e-4, -2e-5])           # fp8 subnormals / underflow
    k, v = k.to(DEVICE), v.to(DEVICE)
    slots = (torch.randperm(S - 1, generator=g)[:n] + 1).int().to(DEVICE)
    ch = torch.stack([torch.randperm(d, generator=g)[:r] for _ in range(hkv)]).int().to(DEVICE)
    ks, vs = _scales(0.05, 0.01)
    pools = [torch.full((S, hkv, d), 2.0, device=DEVICE).to(dtype) for _ in range(2)]
    lab = torch.zeros(S, hkv, r, dtype=torch.bfloat16, device=DEVICE)
    exp = [p.clone() for p in pools] + [lab.clone()]
    ops.store_kv(*pools, k, v, slots, lab, None, ch, ks, vs, impl=impl)
    ref.store_ref(exp[0], exp[1], exp[2], None, k, v, slots, ch, ks, vs)
    for got, want in zip(pools, exp):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    fmax = ref.KV_FP8_MAX[dtype]
    assert pools[0][slots[0].long(), 0, 0].float() == fmax and pools[0][slots[0].long(), 0, 1].float() == -fmax
    # the label is the unquantized k's (bf16 labels: its channels exactly)
    assert torch.equal(lab[slots.long()], torch.gather(k, 2, ch.long()[None].expand(n, -1, -1)))


@pytest.mark.parametrize("dtype", FP8S)
def test_rope_store_quantizes(dtype):
    g = torch.Generator().manual_seed(7)
    t, hq, hkv, d, S = 3, 9, 3, 64, 11
    pos = torch.tensor([0, 5, 40], device=DEVICE)
    q = torch.randn(t, hq, d, generator=g).bfloat16().to(DEVICE)
    k = (torch.randn(t, hkv, d, generator=g) * 2).bfloat16().to(DEVICE)
    v = torch.randn(t, hkv, d, generator=g).bfloat16().to(DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(64).float()[:, None] * inv[None]
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    slots = torch.tensor([3, 9, 1], device=DEVICE)
    ks, vs = _scales(0.03, 0.02)
    pools = [torch.zeros(S, hkv, d, device=DEVICE).to(dtype) for _ in range(2)]
    exp = [p.clone() for p in pools]
    qo, ko = ops.rope_store(pos, q, k, v, cos, sin, *pools, slots, k_scale=ks, v_scale=vs, return_k=True,
                            impl="triton")
    qe, ke = ref.rope_store_ref(pos, q, k, v, cos, sin, *exp, slots, k_scale=ks, v_scale=vs)
    assert torch.equal(pools[1].view(torch.uint8), exp[1].view(torch.uint8))   # v: no arithmetic before
    got, want = pools[0].float(), exp[0].float()
    assert bool(((got - want).abs() <= want.abs() * ULP[dtype] + 1e-6).all())
    # the torch path is exactly rope, then the store
    pools_t = [torch.zeros(S, hkv, d, device=DEVICE).to(dtype) for _ in range(2)]
    ops.rope_store(pos, q, k, v, cos, sin, *pools_t, slots, k_scale=ks, v_scale=vs, impl="torch")
    assert torch.equal(pools_t[0].view(torch.uint8), exp[0].view(torch.uint8))


# ---------------------------------------------------------------- readers
@pytest.mark.parametrize("dtype", FP8S)
def test_dense_decode_dequantizes(dtype):
    c = make_case([37, 5, 130], 9, 3, 64, device=DEVICE, seed=11)
    ks, vs = _scales()
    c8 = fp8_case(c, dtype, ks, vs)
    exp = ref.dense_decode_ref(c8.q, c8.k_cache, c8.v_cache, c8.req_to_token, c8.req_idx, c8.seq_lens,
                               c8.sm_scale, ks, vs)
    ws = make_ws(c8)
    out = torch.full_like(c8.q, float("nan"))
    launch.dense_decode(c8.q, c8.k_cache, c8.v_cache, c8.req_to_token, c8.req_idx, c8.seq_lens, c8.sm_scale,
                        ws, out=out, num_splits=3, k_scale=ks, v_scale=vs)
    assert rel_err(out, exp) < TOL[torch.bfloat16]
    torch_out = ops.dense_decode(c8.q, c8.k_cache, c8.v_cache, c8.req_to_token, c8.req_idx, c8.seq_lens,
                                 c8.sm_scale, impl="torch", k_scale=ks, v_scale=vs)
    assert rel_err(torch_out, exp) < TOL[torch.bfloat16]
    # the scales are applied: close to the bf16 cache's attention, within fp8's rounding
    bf = ref.dense_decode_ref(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_idx, c.seq_lens, c.sm_scale)
    assert rel_err(exp, bf) < FP8_VS_BF16[dtype]


@pytest.mark.parametrize("dtype,mode", [(E4M3, "group_max"), (E5M2, "per_head")])
def test_ds_decode_dequantizes(dtype, mode):
    seq_lens, k = [5, 260, 77], 40                        # the short request decodes densely
    c = make_case(seq_lens, 9, 3, 64, r=8, device=DEVICE, seed=13)
    ks, vs = _scales()
    c8 = fp8_case(c, dtype, ks, vs)
    ws = make_ws(c8, k_max=k + 3)
    out = torch.full_like(c8.q, float("nan"))
    _, sel = ds_launch.ds_decode(*c8.args(), c8.sm_scale, DSDecodeArgs(budgets(c8, k), k, mode), ws=ws, out=out,
                                 num_splits=3, num_progs=2, return_sel=True, k_scale=ks, v_scale=vs)
    assert not out.isnan().any()
    exp = expected_output(dequant_case(c8, ks, vs), sel, k, mode)
    assert rel_err(out, exp) < TOL[torch.bfloat16]
    # the PyTorch path against the whole reference (its own selection: the same labels)
    got = ops.ds_decode(*c8.args(), c8.sm_scale, DSDecodeArgs(budgets(c8, k), k, mode), impl="torch", k_scale=ks,
                        v_scale=vs)
    want = ref.ds_decode_ref(*c8.args(), c8.sm_scale, budgets(c8, k), mode, k_scale=ks, v_scale=vs)
    assert rel_err(got, want) < TOL[torch.bfloat16]


def test_layer_mode_dequantizes():
    seq_lens, k = [150, 33], 24
    c = make_case(seq_lens, 9, 3, 64, r=8, device=DEVICE, seed=17)
    ks, vs = _scales()
    c8 = fp8_case(c, E4M3, ks, vs)
    ws = make_ws(c8, k_max=k, layer_select=True)
    got = ops.ds_decode(*c8.args(), c8.sm_scale, DSDecodeArgs(budgets(c8, k), k, "layer"), ws=ws, impl="triton",
                        k_scale=ks, v_scale=vs)
    want = ref.ds_decode_ref(*c8.args(), c8.sm_scale, budgets(c8, k), "layer", k_scale=ks, v_scale=vs)
    assert rel_err(got, want) < TOL[torch.bfloat16]


def test_fp8_pool_needs_scales():
    c = fp8_case(make_case([9], 4, 2, 64, device=DEVICE, seed=1), E4M3, *_scales())
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        launch.dense_decode(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_idx, c.seq_lens, c.sm_scale,
                            make_ws(c))
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        ops.dense_decode(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_idx, c.seq_lens, c.sm_scale,
                         impl="torch")
    k = torch.zeros(2, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        ops.store_kv(c.k_cache, c.v_cache, k, k, torch.tensor([1, 2], device=DEVICE), impl="torch")
