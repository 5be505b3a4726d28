"""The engine on the MoE and MLA families (tiny random models, CPU): dense decode equals a full
recompute, Double Sparsity with k >= length equals dense, the MLA latent pool, MLA heavy channels,
calibration."""

import argparse
import json

import pytest
import torch

from doublesparse.engine import Engine
from doublesparse.kernels.tuning import DEFAULT_TUNING
from doublesparse.models import greedy_generate
from doublesparse.testing import ByteTokenizer, tiny_family

FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v2"]
GREEDY = {"temperature": 0.0, "ignore_eos": True}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_family(request.param, max_position_embeddings=512)


def engine(model, **kw):
    kw.setdefault("max_total_tokens", 2048)
    kw.setdefault("ds_sparse_decode_threshold", 0)
    return Engine(model=model, tokenizer=ByteTokenizer(), progress=False, max_running_requests=4, **kw)


def prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 250, (int(torch.randint(9, 70, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_dense_equals_recompute_and_ds_full_k_equals_dense(model):
    ps = prompts(3, seed=4)
    sp = {**GREEDY, "max_new_tokens": 8}
    dense = engine(model).generate(ps, sp)
    for p, r in zip(ps, dense):
        assert r["token_ids"] == greedy_generate(model, torch.tensor(p), 8, use_cache=False).tolist()
    e = engine(model, enable_double_sparsity=True, ds_heavy_token_num=128)
    assert [r["token_ids"] for r in e.generate(ps, sp)] == [r["token_ids"] for r in dense]
    assert e.stats()["sparse_decode_steps"] == 0
    sparse = engine(model, enable_double_sparsity=True, ds_heavy_token_num=8)
    sparse.generate(ps, sp)
    assert sparse.stats()["sparse_decode_steps"] > 0


def test_latent_pool_and_channels(model):
    e = engine(model, enable_double_sparsity=True, ds_heavy_token_num=8)
    c, parts = model.config, e.parts
    if c.mla is None:
        assert parts.memory.v is not parts.memory.k and not parts.plan.latent
        return
    assert parts.plan.latent and parts.memory.v is parts.memory.k
    assert parts.plan.kv_bytes_per_token == c.num_layers * c.head_dim * 4 == c.kv_bytes_per_token(4)
    assert parts.backend.channels.shape == (c.num_layers, 1, min(16, c.head_dim // 4))
    assert "weight-based default" in parts.channel_source


def test_mla_channel_scores_match_sampled_energies():
    """The weight-based energies against the latent and absorbed query of random isotropic inputs."""
    from doublesparse.models.mla_channels import mla_channel_scores

    m = tiny_family("deepseek_v2")
    attn = m.layers[1].attn
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        attn.kv_a_norm.weight.copy_(torch.rand(32, generator=g) * 2)
        x = torch.randn(6000, 64, generator=g)
        pos = torch.randint(0, 4000, (6000,), generator=g)
        q, lat = attn.absorbed_query(x, pos, m.rope, DEFAULT_TUNING)
    ek = lat[:, 0].pow(2).mean(0).double()
    eq = (q / attn.q_scale).pow(2).mean(0).double()                     # [heads, 40]
    torch.testing.assert_close(mla_channel_scores(attn, torch.ones(64), "k"), ek.sqrt(), rtol=0.12, atol=0.02)
    torch.testing.assert_close(mla_channel_scores(attn, torch.ones(64), "q"), eq.sqrt().sum(0), rtol=0.12, atol=0.02)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_calibrate_writes_loadable_config(arch, tmp_path):
    from doublesparse.calibrate import cli
    from doublesparse.channels import load_channels

    txt = tmp_path / "t.txt"
    txt.write_text("To be, or not to be, that is the question. " * 12)
    m = tiny_family(arch)
    c = m.config
    args = argparse.Namespace(model_path=None, output=str(tmp_path / "cfg.json"), text=[str(txt)], num_samples=2,
                              seq_len=48, device="cpu", quiet=True, cpu_threads=1, op_seq_len=192, op_windows=1,
                              op_decode_len=8)
    cli.run(args, model=m, tokenizer=ByteTokenizer(), argv_for_meta=["--text", "t.txt"])
    raw = json.loads((tmp_path / "cfg.json").read_text())
    assert len(raw["model.layers.1.self_attn.qk_proj_kv"]) == c.num_kv_heads
    assert len(raw["model.layers.1.self_attn.qk_proj_kv"][0]) == c.head_dim
    assert load_channels(tmp_path / "cfg.json", c, "qk", 4, "group_max").shape == (c.num_layers, c.num_kv_heads, 4)
    # the operating point is measured for the MoE model, not for the MLA one (its latent bytes)
    assert ("doublesparse_operating_point" in raw) == (c.mla is None)


def test_mla_through_triton_kernels_matches_torch():
    """The engine's latent pool (width 32 + 16, one KV head, V pool = K pool) through the Triton
    store, DS score / select and the latent attention kernel under TRITON_INTERPRET=1, against the
    PyTorch path (the kernel alone, dense and DS: tests/kernels/test_latent_attn.py)."""
    import os

    from doublesparse.kernels.workspace import DecodeWorkspace
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    from doublesparse.kernels.latent import latent_split, latent_value_dim

    assert latent_split(576) == (512, 64) and latent_split(40) is None and latent_value_dim(40) == 40
    m = tiny_family("deepseek_v2", max_position_embeddings=512)
    c = m.config
    assert latent_split(c.head_dim) == (32, 16)  # the latent kernel runs (latent_attn.py)
    ps = [list(range(40, 60))]
    sp = {**GREEDY, "max_new_tokens": 2}
    kw = {"enable_double_sparsity": True, "ds_heavy_token_num": 8, "max_total_tokens": 256}
    ref = engine(m, **kw).generate(ps, sp)
    e = engine(m, **kw)
    e.parts.backend.impl = "triton"
    e.parts.backend.workspace = DecodeWorkspace(1, c.num_q_heads, 1, c.head_dim, e.max_context_len, 8, device="cpu")
    out = e.generate(ps, sp)
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in ref]
    assert all(r["meta"]["sparse_decode_steps"] > 0 for r in out)
