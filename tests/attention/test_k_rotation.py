"""The q/K rotation before an fp8 K/V cache (attention/k_rotation.py): orthogonal Hadamard blocks,
scores unchanged, Double Sparsity's label scores unchanged, and the choices."""

import pytest
import torch

from doublesparse.attention import k_rotation as kr


@pytest.mark.parametrize("n", [1, 2, 16, 48, 64, 96, 112, 128])
def test_hadamard_blocks_are_orthogonal(n):
    h = kr.hadamard_blocks(n)
    torch.testing.assert_close(h @ h.T, torch.eye(n), atol=1e-6, rtol=0)
    if n & (n - 1) == 0:
        assert torch.equal(h, kr.hadamard(n)) and torch.allclose(h.abs(), torch.full((n, n), n ** -0.5))
    with pytest.raises(ValueError, match="power of two"):
        kr.hadamard(12)


def test_rotation_keeps_scores_and_spreads_an_outlier():
    torch.manual_seed(0)
    L, Hkv, G, D, T = 2, 3, 3, 64, 5
    rot = kr.rotation_matrices(L, Hkv, D)
    assert rot.shape == (L, Hkv, D, D) and torch.equal(rot[1, 2], kr.hadamard(D))
    q, k = torch.randn(T, Hkv * G, D), torch.randn(T, Hkv, D)
    qr, kk = kr.rotate(q, k, rot[0])
    assert qr.shape == q.shape and kk.shape == k.shape and qr.is_contiguous()
    ref = torch.einsum("thgd,shd->thgs", q.view(T, Hkv, G, D), k)
    torch.testing.assert_close(torch.einsum("thgd,shd->thgs", qr.view(T, Hkv, G, D), kk), ref, atol=1e-4, rtol=1e-4)
    spike = torch.zeros(1, Hkv, D)
    spike[0, :, 5] = 16.0
    assert kr.rotate(q[:1], spike, rot[0])[1].abs().max() == pytest.approx(2.0)   # 16 / sqrt(64)
    assert kr.rotate(q, None, rot[0])[1] is None
    # the heads share R: the one-GEMM path gives the per-head result
    one = kr.shared(rot)
    assert one.shape == (L, 1, D, D) and torch.equal(one[1, 0], rot[1, 2])
    q1, k1 = kr.rotate(q, k, one[0])
    torch.testing.assert_close(q1, qr)
    torch.testing.assert_close(k1, kk)
    assert q1.is_contiguous() and k1.is_contiguous() and kr.rotate(q, None, one[0])[1] is None
    per_head = rot.clone()
    per_head[0, 1] = -per_head[0, 1]
    assert kr.shared(per_head) is per_head   # heads that differ keep their own R


def test_label_channels_keep_their_own_block():
    """The earlier form (measurements only): with label channels the label score of every query
    head is the unrotated one, R mapping the span of the label channels onto itself."""
    torch.manual_seed(1)
    L, Hkv, G, D, r = 2, 2, 4, 64, 16
    ch = torch.stack([torch.stack([torch.randperm(D)[:r] for _ in range(Hkv)]) for _ in range(L)]).int()
    rot = kr.rotation_matrices(L, Hkv, D, ch)
    for layer in range(L):
        for h in range(Hkv):
            R, sel = rot[layer, h], ch[layer, h].long()
            rest = torch.ones(D, dtype=torch.bool)
            rest[sel] = False
            torch.testing.assert_close(R @ R.T, torch.eye(D), atol=1e-6, rtol=0)
            assert R[sel][:, rest].abs().max() == 0 and R[rest][:, sel].abs().max() == 0
    q, k = torch.randn(3, Hkv * G, D), torch.randn(7, Hkv, D)
    qr, kk = kr.rotate(q, k, rot[1])
    for h in range(Hkv):
        sel = ch[1, h].long()
        want = q.view(3, Hkv, G, D)[:, h][..., sel] @ k[:, h][:, sel].T
        got = qr.view(3, Hkv, G, D)[:, h][..., sel] @ kk[:, h][:, sel].T
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="do not match"):
        kr.rotation_matrices(3, Hkv, D, ch)
    dup = ch.clone()
    dup[0, 0, 1] = dup[0, 0, 0]
    with pytest.raises(ValueError, match="repeat a channel"):
        kr.rotation_matrices(L, Hkv, D, dup)


def test_resolve_and_describe():
    assert kr.resolve("auto", True, False) and not kr.resolve("auto", False, False)
    assert not kr.resolve("auto", True, True)            # an MLA latent pool: never by default
    assert not kr.resolve("auto", True, False, default_scales=False)   # scales measured on unrotated K
    assert kr.resolve("hadamard", True, False, default_scales=False)
    assert kr.resolve("hadamard", False, False) and not kr.resolve("none", True, False)
    with pytest.raises(ValueError, match="latent"):
        kr.resolve("hadamard", False, True)
    with pytest.raises(ValueError, match="kv_cache_k_rotation must be one of"):
        kr.resolve("on", True, False)
    assert kr.describe(None, None) == "K not rotated"
    rot = kr.rotation_matrices(1, 1, 64)
    assert "blocks of 64" in kr.describe(rot, None)
    assert "blocks of 64; labels and label scores unrotated" in kr.describe(rot, torch.zeros(1, 1, 16))
