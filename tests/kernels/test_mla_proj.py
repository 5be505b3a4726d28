"""MLA's one-launch steps around attention (kernels/triton/mla_proj.py, under the interpreter on
CPU) against the float32 references and against the model's composed PyTorch ops."""

import pytest
import torch
from conftest import DEVICE

from doublesparse.kernels import ops, reference as ref


def _case(T, nh, dn, dr, R, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, nh, dn + dr + 5, generator=g)[..., :dn + dr]     # a strided view, as q_proj's heads
    kv = torch.randn(T, R + dr, generator=g) * 3
    kvb = torch.randn(nh, dn + dv, R, generator=g) * R ** -0.5          # kv_b_proj's weight as heads
    nw = torch.rand(R, generator=g) + 0.5
    pos = torch.randint(0, 40, (T,), generator=g)
    inv = 1.0 / 10000 ** (torch.arange(0, dr, 2).float() / dr)
    f = torch.outer(torch.arange(64).float(), inv)
    out = torch.randn(T, nh, R + dr, generator=g)
    t = dict(q=q, kv=kv, w_uk=kvb[:, :dn], w_uv=kvb[:, dn:], nw=nw, pos=pos, cos=f.cos(), sin=f.sin(), out=out)
    return {k: (v.to(DEVICE) if k in ("pos", "cos", "sin") else v.to(DEVICE, dtype)) for k, v in t.items()}


@pytest.mark.parametrize(("T", "nh", "dn", "dr", "R", "dv"), [(1, 3, 16, 8, 48, 24), (5, 2, 32, 16, 64, 16),
                                                               (19, 4, 16, 4, 32, 40)])
def test_mla_absorb_and_unabsorb_match_the_references(T, nh, dn, dr, R, dv, poison_empty):
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    c = _case(T, nh, dn, dr, R, dv, dtype, seed=T)
    args = (c["q"], c["kv"], c["pos"], c["cos"], c["sin"], c["w_uk"], c["nw"], 1e-6, 0.37)
    got_q, got_lat = ops.mla_absorb(*args, impl="triton")
    want_q, want_lat = ref.mla_absorb_ref(*args)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    assert got_q.shape == (T, nh, R + dr) and got_lat.shape == (T, 1, R + dr)
    torch.testing.assert_close(got_q.float(), want_q.float(), **tol)
    torch.testing.assert_close(got_lat.float(), want_lat.float(), **tol)
    got_o = ops.mla_unabsorb(c["out"], c["w_uv"], impl="triton")
    torch.testing.assert_close(got_o.float(), ref.mla_unabsorb_ref(c["out"], c["w_uv"]).float(), **tol)


def test_mla_absorb_is_the_models_composition():
    """The reference is what models/mla.py computes with separate ops: RMSNorm, the pair reorder,
    rotate-half RoPE, the batched GEMM through W_UK, the scale, and out through W_UV (float32)."""
    from doublesparse.models.mla import _rotate_half_order
    T, nh, dn, dr, R, dv = 3, 2, 16, 8, 32, 24
    c = _case(T, nh, dn, dr, R, dv, torch.float32, seed=9)
    c = {k: v.cpu() for k, v in c.items()}
    q_lat = torch.bmm(c["q"][..., :dn].transpose(0, 1), c["w_uk"]).transpose(0, 1)
    q_rope = ref.rope_ref(c["pos"], _rotate_half_order(c["q"][..., dn:]), c["cos"], c["sin"])
    k_rope = ref.rope_ref(c["pos"], _rotate_half_order(c["kv"][:, R:])[:, None], c["cos"], c["sin"])
    lat = torch.cat([ref.rmsnorm_ref(c["kv"][:, :R], c["nw"], 1e-6)[:, None], k_rope], dim=-1)
    q, latent = ref.mla_absorb_ref(c["q"], c["kv"], c["pos"], c["cos"], c["sin"], c["w_uk"], c["nw"], 1e-6, 0.5)
    torch.testing.assert_close(q, torch.cat([q_lat, q_rope], dim=-1) * 0.5)
    torch.testing.assert_close(latent, lat)
    o = torch.bmm(c["out"][..., :R].transpose(0, 1), c["w_uv"].transpose(1, 2)).transpose(0, 1).reshape(T, -1)
    torch.testing.assert_close(ref.mla_unabsorb_ref(c["out"], c["w_uv"]), o)


def test_mla_launchers_take_an_empty_step():
    from doublesparse.kernels.triton import mla_proj
    c = _case(2, 2, 16, 8, 32, 16, torch.float32)
    q, lat = mla_proj.mla_absorb(c["q"][:0], c["kv"][:0], c["pos"][:0], c["cos"], c["sin"], c["w_uk"], c["nw"], 1e-6, 1.0)
    assert q.shape == (0, 2, 40) and lat.shape == (0, 1, 40)
    assert mla_proj.mla_unabsorb(c["out"][:0], c["w_uv"]).shape == (0, 32)


def test_mla_launchers_refuse_bad_shapes():
    from doublesparse.kernels.triton import mla_proj
    c = _case(2, 2, 16, 8, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="disagree"):
        mla_proj.mla_absorb(c["q"], c["kv"][:, 1:], c["pos"], c["cos"], c["sin"], c["w_uk"], c["nw"], 1e-6, 1.0)
    with pytest.raises(ValueError, match="disagree"):
        mla_proj.mla_unabsorb(c["out"][:, :1], c["w_uv"])
    with pytest.raises(ValueError, match="positions"):
        mla_proj.mla_absorb(c["q"], c["kv"], c["pos"][:1], c["cos"], c["sin"], c["w_uk"], c["nw"], 1e-6, 1.0)
    with pytest.raises(ValueError, match="cos/sin"):
        mla_proj.mla_absorb(c["q"], c["kv"], c["pos"], c["cos"][:, :2], c["sin"][:, :2], c["w_uk"], c["nw"], 1e-6, 1.0)
