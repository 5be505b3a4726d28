"""The Triton grouped-GEMM MoE path (kernels/triton/moe.py, under the interpreter on CPU) against
the PyTorch expert path, and its block layout."""

import pytest
import torch
from conftest import DEVICE

from doublesparse.kernels.triton.moe import align_blocks, fused_experts
from doublesparse.models.moe import experts_torch


def _case(T, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    logits[:, 0] += 3.0  # one expert takes most tokens: more than a block of them
    w, ids = logits.softmax(-1).topk(K)
    return g, w, ids


@pytest.mark.parametrize(("T", "E", "K"), [(23, 5, 3), (3, 7, 2)])
def test_align_blocks_layout(T, E, K):
    _, _, ids = _case(T, E, K, seed=T)
    rows, bexp = align_blocks(ids, E, 16)
    flat = ids.reshape(-1)
    blocks = rows.view(-1, 16)
    real = rows[rows < T * K]
    assert sorted(real.tolist()) == list(range(T * K))  # every assignment exactly once
    for b, e in enumerate(bexp.tolist()):
        r = blocks[b][blocks[b] < T * K]
        if e < 0:
            assert r.numel() == 0
        else:
            assert r.numel() > 0 and bool((flat[r] == e).all())


def test_fused_experts_matches_torch():
    """On the test device: CPU float32 under the interpreter, CUDA bf16 compiled."""
    T, H, inter, E, K = 23, 40, 24, 5, 3
    g, w, ids = _case(T, E, K, seed=1)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * inter, H, generator=g), torch.randn(E, H, inter, generator=g)
    assert int((ids == 0).sum()) > 16
    x, w13, w2, w, ids = (t.to(DEVICE) for t in (x, w13, w2, w, ids))
    x, w13, w2 = (t.to(dtype) for t in (x, w13, w2))
    got = fused_experts(x, w13, w2, w, ids, block_n=16, block_k=16).float()
    want = experts_torch(x.float(), w13.float(), w2.float(), w, ids)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
