"""The Triton GEMV of small decode projections vs a float32 reference (and its dispatch rule)."""

import pytest
import torch

from conftest import DEVICE
from doublesparse.kernels import ops
from doublesparse.kernels.triton import fused_launch
from doublesparse.models import layers


@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("n,k", [(40, 100), (576, 576)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_matches_reference(m, n, k, bias, dtype):
    g = torch.Generator().manual_seed(m * 1000 + n + k + bias)
    wide = torch.randn(m, k + 8, generator=g).to(dtype).to(DEVICE)
    x = wide[:, :k]                                # strided rows
    w = torch.randn(n, k, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    want = x.float() @ w.float().T + (b.float() if bias else 0)
    got = ops.linear_small(x, w, b, impl="triton")
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * k ** 0.5)


def test_gemv_refuses_bad_shapes():
    x = torch.randn(5, 8, device=DEVICE)
    with pytest.raises(ValueError, match="rows"):
        fused_launch.gemv(x, torch.randn(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="does not match"):
        fused_launch.gemv(x[:2], torch.randn(4, 7, device=DEVICE))


def test_linear_uses_gemv_only_for_small_cuda_inputs(monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "linear_small", lambda *a, **kw: calls.append(kw) or torch.zeros(1))
    lin = layers.Linear(8, 4)
    torch.nn.init.normal_(lin.weight)
    lin(torch.randn(2, 8))                         # CPU: never the Triton kernel under "auto"
    assert calls == []
    monkeypatch.setattr(layers, "TRITON_GEMV", True)
    lin(torch.randn(2, 8))
    lin(torch.randn(9, 8))                         # too many rows: F.linear
    assert len(calls) == 1
