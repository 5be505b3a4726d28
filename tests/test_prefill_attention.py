"""Prefill attention (attention/base._sdpa): GQA-native SDPA calls and the backend order give the
float32 reference's answer, for whole prompts and for chunks after a cached prefix."""

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

from conftest import DEVICE
from doublesparse.attention.base import _sdpa


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
@pytest.mark.parametrize("n,prefix", [(37, 0), (53, 91)])
def test_sdpa_matches_reference(dtype, hq, hkv, d, n, prefix):
    g = torch.Generator(device="cpu").manual_seed(hq * 1000 + n + prefix)
    L = n + prefix
    q = torch.randn(hq, n, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(hkv, L, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(hkv, L, d, generator=g).to(DEVICE, dtype)
    mask = causal_lower_right(n, L) if prefix else None
    out = _sdpa(q, k, v, mask, d ** -0.5)
    assert out.shape == (hq, n, d) and out.dtype == dtype
    exp = _reference(q, k, v, prefix, d ** -0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert (out.float() - exp).abs().max().item() < tol
