"""The host-gather copies (kernels/host_copy.py, kernels/triton/host_gather.py) with fp8 K/V pools:
float rows into an fp8 pool are quantized bit for bit as the store kernels quantize them (clamps,
signed zeros, subnormals included), fp8 rows move unchanged between fp8 pools; on CPU the Triton
kernel runs under the interpreter at awkward sizes (5 heads, D 24, 37 entries, some masked)."""

import pytest
import torch

from conftest import DEVICE
from doublesparse.kernels.host_copy import copy_from_tiers, copy_rows, copy_rows_ref
from doublesparse.kernels.reference import KV_FP8_MAX, quantize_kv

FP8S = [torch.float8_e4m3fn, torch.float8_e5m2]
IMPLS = ["torch", "triton"]


def _bits(t):
    return t.view(torch.uint8)


def _entries(g, E=37, S_src=61, S_dst=29, H=5):
    """Entries that never share a destination, about a third masked."""
    src_rows = torch.randint(0, S_src, (E,), generator=g)
    dst_rows = torch.randperm(S_dst * H, generator=g)[:E] // H
    heads = torch.randint(0, H, (E,), generator=g)
    key = dst_rows * H + heads
    valid = (torch.rand(E, generator=g) > 0.3) & (torch.bincount(key, minlength=S_dst * H)[key] == 1)
    return [t.to(DEVICE) for t in (src_rows, dst_rows, heads, valid)]


def _skip_interpreted_on_gpu(impl):
    if impl == "triton" and torch.cuda.is_available():
        pytest.skip("the interpreter twin is for CPU tensors; on a GPU the kernel runs natively")


@pytest.mark.parametrize("dtype", FP8S)
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("impl", IMPLS)
def test_copy_into_fp8_quantizes(impl, src_dtype, dtype):
    _skip_interpreted_on_gpu(impl)
    g = torch.Generator().manual_seed(0)
    src_k = (torch.randn(61, 5, 24, generator=g) * 3).to(src_dtype)
    src_v = torch.randn(61, 5, 24, generator=g).to(src_dtype)
    src_k[:, 0, :4] = torch.tensor([1e4, -1e4, 0.0, -0.0]).to(src_dtype)   # clamped; signed zeros
    src_v[:, 1, :3] = torch.tensor([1e-6, 3e-4, -2e-5]).to(src_dtype)      # fp8 subnormals / underflow
    src_k, src_v = src_k.to(DEVICE), src_v.to(DEVICE)
    ks, vs = torch.tensor([0.05], device=DEVICE), torch.tensor([0.01], device=DEVICE)
    e = _entries(g)
    dst = [torch.full((29, 5, 24), 2.0, device=DEVICE).to(dtype) for _ in range(2)]
    copy_rows(src_k, src_v, *dst, *e, impl=impl, k_scale=ks, v_scale=vs)
    s, t, h, ok = (x.cpu() for x in e)
    for got, src, scale in ((dst[0], src_k, ks), (dst[1], src_v, vs)):
        want = torch.full((29, 5, 24), 2.0).to(dtype)
        want[t[ok], h[ok]] = quantize_kv(src.cpu()[s[ok], h[ok]], dtype, scale.cpu())
        assert torch.equal(_bits(got.cpu()), _bits(want))
    hit = dst[0].cpu()[t[ok], h[ok]].float()
    assert (hit.abs() == KV_FP8_MAX[dtype]).any()


@pytest.mark.parametrize("dtype", FP8S)
@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_rows_move_unchanged(impl, dtype):
    """A fetch (host store -> hot set) and a gather through a tiered store: the bytes as stored."""
    _skip_interpreted_on_gpu(impl)
    g = torch.Generator().manual_seed(1)
    src_k = (torch.randn(61, 5, 24, generator=g) * 20).to(dtype).to(DEVICE)
    src_v = torch.randn(61, 5, 24, generator=g).to(dtype).to(DEVICE)
    e = _entries(g)
    got = [torch.zeros(29, 5, 24, device=DEVICE).to(dtype) for _ in range(2)]
    want = [torch.zeros(29, 5, 24).to(dtype) for _ in range(2)]
    copy_rows(src_k, src_v, *got, *e, impl=impl)
    copy_rows_ref(src_k.cpu(), src_v.cpu(), *want, *(x.cpu() for x in e))
    assert torch.equal(_bits(got[0].cpu()), _bits(want[0])) and torch.equal(_bits(got[1].cpu()), _bits(want[1]))
    assert got[0].float().abs().sum() > 0
    # slots 1..20 in a device tier, the rest in the host part at slot - 20
    tiers = (src_k[20:].clone(), src_v[20:].clone(), src_k[:21].clone(), src_v[:21].clone(), 20)
    slots = (e[0] % 60 + 1)
    got2 = [torch.zeros(29, 5, 24, device=DEVICE).to(dtype) for _ in range(2)]
    copy_from_tiers(tiers, *got2, slots, *e[1:], impl=impl)
    want2 = [torch.zeros(29, 5, 24).to(dtype) for _ in range(2)]
    copy_rows_ref(src_k.cpu(), src_v.cpu(), *want2, slots.cpu(), *(x.cpu() for x in e[1:]))
    assert torch.equal(_bits(got2[0].cpu()), _bits(want2[0])) and torch.equal(_bits(got2[1].cpu()), _bits(want2[1]))


def test_fp8_copies_refuse_what_they_cannot_do():
    a8 = torch.zeros(4, 2, 8, dtype=torch.float8_e4m3fn)
    b8 = torch.zeros(4, 2, 8, dtype=torch.float8_e5m2)
    f = torch.zeros(4, 2, 8)
    idx = torch.zeros(2, dtype=torch.long)
    ok = torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        copy_rows(f, f, a8, a8, idx, idx, idx, ok)
    with pytest.raises(ValueError, match="own format only"):
        copy_rows(a8, a8, b8, b8, idx, idx, idx, ok)
    with pytest.raises(ValueError, match="dequantize"):
        copy_rows(a8, a8, f, f, idx, idx, idx, ok)
    with pytest.raises(ValueError, match="K and V pools differ"):
        copy_rows(f, f, a8, b8, idx, idx, idx, ok, k_scale=torch.ones(1), v_scale=torch.ones(1))
    with pytest.raises(ValueError, match="k_scale has dtype"):
        copy_rows(f, f, a8, a8, idx, idx, idx, ok, k_scale=torch.ones(1, dtype=torch.float64),
                  v_scale=torch.ones(1))
