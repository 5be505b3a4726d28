"""The decode expert path (kernels/triton/moe_decode.py; under the interpreter on CPU) against the
float32 reference at awkward sizes: few tokens, 7 experts, sizes no tile divides, experts without
tokens, every token on one expert, more tokens on an expert than one 16-row pass."""

import pytest
import torch
from conftest import DEVICE

from doublesparse.kernels import ops
from doublesparse.kernels import reference as ref
from doublesparse.kernels.triton import moe_decode as md
from doublesparse.kernels.tuning import KernelTuning

# 16-wide tiles: H = 40 and I = 24 take several K steps and N tiles, the last ones partial
SMALL = KernelTuning(moe_gate_up_block_n=16, moe_down_block_n=16, moe_decode_block_k=16)


def _case(T, E, K, H, inter, dtype, seed, one_expert=False, shared=False, mlp_inter=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    if one_expert:
        logits[:, 3] += 100.0  # every token's first choice
    w, ids = logits.softmax(-1).topk(K)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter ** 0.5
    s = torch.randn(T, H, generator=g) if shared else None
    cast = [t.to(dtype).to(DEVICE) for t in (x, w13, w2)]
    out = (*cast, w.to(DEVICE), ids.to(DEVICE), None if s is None else s.to(dtype).to(DEVICE))
    if not mlp_inter:
        return out
    sw13 = torch.randn(2 * mlp_inter, H, generator=g) / H ** 0.5
    sw2 = torch.randn(H, mlp_inter, generator=g) / mlp_inter ** 0.5
    return (*out, sw13.to(dtype).to(DEVICE), sw2.to(dtype).to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "K", "one_expert", "shared", "mlp_inter"),
                         [(1, 2, False, False, 0), (3, 3, False, True, 40), (5, 2, True, False, 8),
                          (5, 3, False, False, 0)])
def test_moe_decode_matches_reference(T, K, one_expert, shared, mlp_inter, dtype):
    """mlp_inter: the shared experts' MLP in the same launches, wider (40) or narrower (8) than
    the routed experts' 24."""
    E, H, inter = 7, 40, 24
    x, w13, w2, w, ids, s, *mlp = _case(T, E, K, H, inter, dtype, seed=T * 10 + K, one_expert=one_expert,
                                        shared=shared, mlp_inter=mlp_inter)
    sw13, sw2 = mlp or (None, None)
    touched = set(ids.flatten().tolist())
    assert len(touched) < E or T * K == 15  # experts without tokens (all 7 touched at 5 x 3)
    if one_expert:
        assert bool((ids == 3).any(1).all())
    out = torch.full((T, H), float("nan"), dtype=dtype, device=DEVICE)  # poisoned: every entry written
    for _ in range(2):  # the same counters twice: each tile's last program leaves them at zero
        y = md.moe_decode(x, w13, w2, w, ids, s, out=out, shared_w13=sw13, shared_w2=sw2, tuning=SMALL)
        assert y is out and not y.isnan().any()
        assert int(md._COUNTERS[x.device].abs().sum()) == 0
    want = ref.moe_experts_ref(x, w13, w2, w, ids, s, sw13, sw2)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(y.float(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_decode_more_tokens_than_a_pass(dtype):
    """18 tokens all on expert 3 (two 16-row passes), default tiles (one K step, one partial N tile)."""
    T, E, K, H, inter = 18, 7, 2, 40, 24
    x, w13, w2, w, ids, _ = _case(T, E, K, H, inter, dtype, seed=5, one_expert=True)
    y = ops.moe_experts(x, w13, w2, w, ids, impl="triton", tuning=KernelTuning(moe_decode_max_tokens=64))
    want = ref.moe_experts_ref(x, w13, w2, w, ids)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(y.float(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_dispatch_and_torch_path():
    """ops.moe_experts: decode path up to moe_decode_max_tokens, the grouped GEMM above; the torch
    path is the reference; all three agree."""
    x, w13, w2, w, ids, s, sw13, sw2 = _case(3, 7, 2, 40, 24, torch.float32, seed=9, shared=True, mlp_inter=20)
    want = ops.moe_experts(x, w13, w2, w, ids, s, sw13, sw2, impl="torch")
    on = KernelTuning(moe_decode_max_tokens=64)
    assert md.decode_fits(x, 2, on) and not md.decode_fits(x, 2, KernelTuning(moe_decode_max_tokens=2))
    assert not md.decode_fits(x, md.MAX_TOKENS, on) and not md.decode_fits(x, 2)  # the default: grouped
    for t in (on, KernelTuning()):
        got = ops.moe_experts(x, w13, w2, w, ids, s, sw13, sw2, impl="triton", tuning=t)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_bad_arguments_raise_value_error():
    x, w13, w2, w, ids, _ = _case(3, 7, 2, 40, 24, torch.float32, seed=1)
    with pytest.raises(ValueError, match="w2"):
        md.moe_decode(x, w13, w2[:, :, :8], w, ids)
    with pytest.raises(ValueError, match="w13"):
        md.moe_decode(x, w13.to(torch.bfloat16), w2, w, ids)
    with pytest.raises(ValueError, match="ids"):
        md.moe_decode(x, w13, w2, w, ids[:2])
    with pytest.raises(ValueError, match="shared"):
        md.moe_decode(x, w13, w2, w, ids, torch.zeros(3, 8, device=DEVICE))
    with pytest.raises(ValueError, match="come together"):
        md.moe_decode(x, w13, w2, w, ids, shared_w13=torch.zeros(16, 40, device=DEVICE))
    with pytest.raises(ValueError, match="shared_w13"):
        md.moe_decode(x, w13, w2, w, ids, shared_w13=torch.zeros(16, 40, device=DEVICE),
                      shared_w2=torch.zeros(40, 4, device=DEVICE))
    with pytest.raises(ValueError, match="moe_decode_block_k"):
        KernelTuning(moe_decode_block_k=24)
