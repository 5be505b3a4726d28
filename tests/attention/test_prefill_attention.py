"""Prefill attention (attention/prefill.py): GQA-native SDPA calls, the backend order and the
split-prefix path give the float32 reference's answer, for whole prompts and for chunks after a
cached prefix."""

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

from conftest import DEVICE
from doublesparse.attention import prefill
from doublesparse.kernels.tuning import KernelTuning


def _reference(q, k, v, prefix, scale):
    # q [Hq, n, D], k/v [Hkv, L, D]; query i sits at position prefix + i
    g = q.shape[0] // k.shape[0]
    k, v = k.float().repeat_interleave(g, 0), v.float().repeat_interleave(g, 0)
    s = q.float() @ k.transpose(1, 2) * scale
    n, L = q.shape[1], k.shape[1]
    allowed = torch.arange(L, device=q.device)[None, :] <= prefix + torch.arange(n, device=q.device)[:, None]
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
@pytest.mark.parametrize("n,prefix,split", [(37, 0, False), (53, 91, False), (53, 91, True), (53, 91, None), (1, 40, True)])
def test_sdpa_matches_reference(dtype, hq, hkv, d, n, prefix, split):
    tuning = KernelTuning(prefill_split_prefix=split)
    g = torch.Generator(device="cpu").manual_seed(hq * 1000 + n + prefix)
    L = n + prefix
    q = torch.randn(hq, n, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(hkv, L, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(hkv, L, d, generator=g).to(DEVICE, dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    mask = causal_lower_right(n, L) if prefix else None
    out = prefill.prefill_sdpa(q, k, v, prefix, d ** -0.5, mask, tuning)
    if prefix:  # the engine passes q as a transposed [n, Hq, D] view, and may leave the mask to us
        qt = q.transpose(0, 1).contiguous().transpose(0, 1)
        got = prefill.prefill_sdpa(qt, k, v, prefix, d ** -0.5, tuning=tuning)
        assert (got.float() - out.float()).abs().max().item() < tol
    assert out.shape == (hq, n, d) and out.dtype == dtype
    exp = _reference(q, k, v, prefix, d ** -0.5)
    assert (out.float() - exp).abs().max().item() < tol
