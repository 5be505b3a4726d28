"""The Triton grouped-GEMM MoE path (kernels/triton/moe.py, under the interpreter on CPU) against
the PyTorch expert path, and its block layout."""

import pytest
import torch
from conftest import DEVICE

from doublesparse.kernels.triton.moe import ALIGN_MAX_ASSIGNMENTS, align_blocks, align_blocks_launch, fused_experts
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
    # the shared experts' output added inside the sum's launch (a strided view: rows of a wider tensor)
    add = torch.randn(T, 2 * H, generator=g).to(DEVICE, dtype)[:, :H]
    got = fused_experts(x, w13, w2, w, ids, block_n=16, block_k=16, add=add).float()
    want = want + add.float()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    with pytest.raises(ValueError, match="add must be"):
        fused_experts(x, w13, w2, w, ids, add=add[:1])
    assert fused_experts(x[:0], w13, w2, w[:0], ids[:0]).shape == (0, H)   # an empty step
    rows, bexp = align_blocks_launch(ids[:0], E)
    assert rows.numel() == 0 and bexp.numel() == 0


@pytest.mark.parametrize(("T", "E", "K", "skew"), [(1, 128, 8, 0.0), (4, 128, 8, 0.0), (23, 5, 3, 3.0), (3, 7, 2, 0.0),
                                                   (64, 128, 8, 5.0), (5, 256, 8, 0.0), (40, 3, 2, 9.0),
                                                   (128, 8, 8, 0.0), (1, 1, 1, 0.0)])   # 1024 assignments: the bound
def test_align_blocks_in_one_launch_equals_the_device_ops(T, E, K, skew, poison_empty):
    """The one-launch layout is align_blocks' bit for bit (rows in the same stable order, the same
    padding, the same block experts), on poisoned outputs, int64 and int32 ids."""
    g = torch.Generator().manual_seed(T * E)
    logits = torch.randn(T, E, generator=g)
    logits[:, 0] += skew  # skewed: one expert over several blocks
    ids = logits.topk(K).indices.to(DEVICE)
    want = align_blocks(ids, E)
    for dtype in (torch.int64, torch.int32):
        got = align_blocks_launch(ids.to(dtype), E)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_align_blocks_in_one_launch_refuses_prefill_sizes():
    ids = torch.zeros(ALIGN_MAX_ASSIGNMENTS + 1, 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="at most"):
        align_blocks_launch(ids, 4)
    with pytest.raises(TypeError, match="int32 or int64"):
        align_blocks_launch(ids[:4].float(), 4)


@pytest.mark.parametrize(("T", "E", "K", "renorm", "scale"), [(1, 128, 8, True, 1.0), (5, 64, 6, False, 1.0),
                                                             (37, 5, 3, True, 2.5), (3, 160, 1, False, 16.0),
                                                             (2, 7, 7, True, 1.0), (3, 1, 1, True, 1.0)])
def test_route_in_one_launch_matches_the_reference(T, E, K, renorm, scale, poison_empty):
    """The one-launch router (softmax, top-k, renormalise, scale) against the token-by-token
    reference and the PyTorch ops, logits in bf16 and float32, on poisoned outputs."""
    from doublesparse.kernels import ops, reference
    g = torch.Generator().manual_seed(T + E)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(T, E, generator=g) * 3).to(dtype)
        want_w, want_i = reference.moe_route_ref(logits, K, renorm, scale)
        got_w, got_i = ops.moe_route(logits.to(DEVICE), K, renorm, scale, impl="triton")
        assert got_w.dtype == torch.float32 and got_i.dtype == torch.int64 and got_w.shape == (T, K)
        assert torch.equal(got_i.cpu(), want_i)
        torch.testing.assert_close(got_w.cpu(), want_w, rtol=1e-5, atol=1e-6)
        torch_w, torch_i = ops.moe_route(logits, K, renorm, scale, impl="torch")
        torch.testing.assert_close(torch_w, want_w, rtol=1e-5, atol=1e-6)
        if dtype == torch.float32:  # bf16 logits tie, and torch.topk breaks ties its own way
            assert torch.equal(torch_i, want_i)


def test_route_ties_go_to_the_lowest_expert():
    from doublesparse.kernels import ops
    logits = torch.zeros(2, 9)
    logits[1, 4] = 1.0
    w, ids = ops.moe_route(logits.to(DEVICE), 3, False, impl="triton")
    assert ids.cpu().tolist() == [[0, 1, 2], [4, 0, 1]]
    with pytest.raises(ValueError, match="top_k"):
        ops.moe_route(logits.to(DEVICE), 10, False, impl="triton")
