"""The fp8 KV cache end to end (``--kv-cache-dtype``): flags, pool sizing in tokens, scales, and the
tiny model generating with fp8 pools (dense, Double Sparsity, prefix-cache hits, chunked prefill)."""

import json
from types import SimpleNamespace

import pytest
import torch

from doublesparse.config import EngineConfig
from doublesparse.config_flags import add_cli_args, from_cli_args
from doublesparse.engine import Engine
from doublesparse.engine import kv_scales
from doublesparse.engine.memory import plan_memory
from doublesparse.testing import ByteTokenizer, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = dict(temperature=0.0, ignore_eos=True)
# Llama-3.1-8B's shape: what the pool holds at a fixed budget is set by its bytes per token
BIG = SimpleNamespace(num_layers=32, num_kv_heads=8, head_dim=128, num_q_heads=32, hidden_size=4096,
                      intermediate_size=14336)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, max_position_embeddings=512)


def engine(model, **kw):
    kw.setdefault("max_total_tokens", 2048)
    kw.setdefault("max_running_requests", 4)
    return Engine(model=model, tokenizer=ByteTokenizer(), progress=False, **kw)


def prompts(n, seed=0, lo=20, hi=90):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


# ---------------------------------------------------------------- flags
def test_flag_parses_and_validates():
    import argparse
    p = add_cli_args(argparse.ArgumentParser())
    assert from_cli_args(p.parse_args([])).kv_cache_dtype == "auto"
    cfg = from_cli_args(p.parse_args(["--kv-cache-dtype", "fp8_e5m2", "--kv-cache-scales-path", "s.json"]))
    assert cfg.kv_cache_dtype == "fp8_e5m2" and cfg.kv_cache_fp8 and cfg.kv_cache_scales_path == "s.json"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "fp8"])
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_scales_path"):
        EngineConfig(kv_cache_scales_path="s.json")
    assert EngineConfig(kv_cache_dtype="fp8_e4m3", enable_ds_offload=True).kv_cache_fp8   # DS-Offload too
    assert not EngineConfig(kv_cache_dtype="bf16").kv_cache_fp8


def test_mla_latent_pool_refuses_fp8():
    mc = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=576, mla=object(), name="deepseek-v2-lite")
    with pytest.raises(ValueError, match="MLA latent pool of deepseek-v2-lite"):
        plan_memory(EngineConfig(kv_cache_dtype="fp8_e4m3", max_total_tokens=10), mc, torch.bfloat16,
                    torch.device("cpu"), 16, 0)


# ---------------------------------------------------------------- pool sizing
@pytest.mark.parametrize("r,label", [(0, "bf16"), (16, "fp8"), (16, "bf16")])
def test_pool_tokens_at_a_fixed_budget(monkeypatch, r, label):
    """The same free GPU memory holds twice the tokens with fp8 K/V (a bit less with labels,
    which keep their own dtype)."""
    free = 40 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    dev = torch.device("cuda")
    plans = {d: plan_memory(EngineConfig(kv_cache_dtype=d, ds_label_dtype=label, mem_fraction_static=0.9),
                            BIG, torch.bfloat16, dev, 32768, r) for d in ("auto", "fp8_e4m3", "fp8_e5m2")}
    assert plans["auto"].kv_dtype == torch.bfloat16 and plans["fp8_e4m3"].kv_dtype == torch.float8_e4m3fn
    assert plans["fp8_e5m2"].kv_bytes_per_token * 2 == plans["auto"].kv_bytes_per_token
    ratio = plans["fp8_e4m3"].max_total_tokens / plans["auto"].max_total_tokens
    assert ratio >= (1.99 if r == 0 else 1.85 if label == "bf16" else 1.9)
    assert "KV float8_e4m3fn" in plans["fp8_e4m3"].describe()


def test_cpu_pool_bound_doubles():
    cpu = torch.device("cpu")
    bf = plan_memory(EngineConfig(kv_cache_dtype="bf16"), BIG, torch.float32, cpu, 4096, 0)
    f8 = plan_memory(EngineConfig(kv_cache_dtype="fp8_e4m3"), BIG, torch.float32, cpu, 4096, 0)
    assert f8.max_total_tokens == 2 * bf.max_total_tokens


# ---------------------------------------------------------------- scales
def test_scales_file_and_checkpoint(tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"k_scale": 0.5, "v_scale": [0.25, 0.125]}))
    cfg = EngineConfig(kv_cache_dtype="fp8_e4m3", kv_cache_scales_path=str(f))
    assert kv_scales.resolve_scales(cfg, None, 2) == ([0.5, 0.5], [0.25, 0.125], str(f))
    f.write_text(json.dumps({"k_scale": [1.0], "v_scale": 1.0}))
    with pytest.raises(ValueError, match="k_scale has 1 values for 2 layers"):
        kv_scales.resolve_scales(cfg, None, 2)
    f.write_text(json.dumps({"k_scale": -1.0, "v_scale": 1.0}))
    with pytest.raises(ValueError, match="positive finite"):
        kv_scales.resolve_scales(cfg, None, 2)
    from safetensors.torch import save_file
    ck = tmp_path / "ckpt"
    ck.mkdir()
    save_file({f"model.layers.{i}.self_attn.{n}_scale": torch.tensor(0.1 * (i + 1) + (n == "v"))
               for i in range(2) for n in "kv"}, str(ck / "model.safetensors"))
    k, v, src = kv_scales.resolve_scales(EngineConfig(kv_cache_dtype="fp8_e4m3"), str(ck), 2)
    assert k == pytest.approx([0.1, 0.2]) and v == pytest.approx([1.1, 1.2]) and "checkpoint" in src
    assert kv_scales.resolve_scales(EngineConfig(kv_cache_dtype="fp8_e4m3"), str(tmp_path), 2)[2] == "default 1.0"


def test_engine_applies_scales(model, tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"k_scale": [0.02, 0.03], "v_scale": 0.01}))
    e = engine(model, kv_cache_dtype="fp8_e4m3", kv_cache_scales_path=str(f))
    m = e.parts.memory
    assert [float(x) for x in m.k_scale] == pytest.approx([0.02, 0.03])
    assert [float(x) for x in m.v_scale] == pytest.approx([0.01, 0.01])
    assert e.parts.backend.k_rotation is None   # auto: scales from a file describe unrotated K
    forced = engine(model, kv_cache_dtype="fp8_e4m3", kv_cache_scales_path=str(f), kv_cache_k_rotation="hadamard")
    assert forced.parts.backend.k_rotation is not None
    r = e.generate(prompts(1, seed=4), {**GREEDY, "max_new_tokens": 4})[0]
    assert r["meta"]["completion_tokens"] == 4


# ---------------------------------------------------------------- generation
def _agree(a, b):
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))


@pytest.mark.parametrize("ds", [False, True])
def test_fp8_generates_close_to_the_model_dtype_cache(model, ds):
    kw = dict(enable_double_sparsity=True, ds_heavy_token_num=16, ds_sparse_decode_threshold=0) if ds else {}
    ps = prompts(3, seed=1)
    sp = {**GREEDY, "max_new_tokens": 8}
    base = engine(model, **kw).generate(ps, sp)
    for dt in ("fp8_e4m3", "fp8_e5m2"):
        e = engine(model, kv_cache_dtype=dt, **kw)
        assert e.parts.memory.k[0].dtype == {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[dt]
        assert e.stats()["kv_cache_dtype"] == e.parts.memory.k[0].dtype.__repr__().removeprefix("torch.")
        res = e.generate(ps, sp)
        assert all(r["meta"]["completion_tokens"] == 8 for r in res)
        if ds:
            assert all(r["meta"]["sparse_decode_steps"] > 0 for r in res)
        # the random toy model's greedy tokens follow the float32 cache's mostly (e4m3 keeps 3
        # mantissa bits, e5m2 only 2, which moved one of these prompts from its first token on;
        # with k = 16 of the context the sparse runs drift sooner, e5m2 most: 0.21 - 0.58 over
        # prompt seeds 1-5, whether q/K are rotated or not): the kernel tests pin the values
        agree = sum(_agree(r["token_ids"], b["token_ids"]) for r, b in zip(res, base)) / 3
        assert agree >= (0.9 if dt == "fp8_e4m3" and not ds else 0.5 if dt == "fp8_e4m3" else 0.3)


def test_fp8_prefix_hit_and_chunks_match_a_cold_prefill(model):
    """A cached prefix is read back as the fp8 values a cold prefill attended to, so a prefix-cache
    hit, a chunked prefill and a cold one give the same tokens."""
    p = prompts(1, seed=2, lo=80, hi=81)[0]
    sp = {**GREEDY, "max_new_tokens": 6}
    cold = engine(model, kv_cache_dtype="fp8_e4m3", disable_radix_cache=True).generate([p], sp)[0]
    e = engine(model, kv_cache_dtype="fp8_e4m3")
    e.generate([p[:50]], {**GREEDY, "max_new_tokens": 1})
    hit = e.generate([p], sp)[0]
    assert e.stats()["prefix_cache_hit_tokens"] >= 49
    chunked = engine(model, kv_cache_dtype="fp8_e4m3", chunked_prefill_size=16,
                     disable_radix_cache=True).generate([p], sp)[0]
    assert hit["token_ids"] == cold["token_ids"] == chunked["token_ids"]


# ---------------------------------------------------------------- q/K rotation
def test_rotation_flag_parses_and_validates():
    import argparse
    p = add_cli_args(argparse.ArgumentParser())
    assert from_cli_args(p.parse_args([])).kv_cache_k_rotation == "auto"
    assert from_cli_args(p.parse_args(["--kv-cache-k-rotation", "none"])).kv_cache_k_rotation == "none"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-k-rotation", "on"])
    with pytest.raises(ValueError, match="kv_cache_k_rotation must be one of"):
        EngineConfig(kv_cache_k_rotation="on")


@pytest.mark.parametrize("ds", [False, True])
def test_fp8_rotates_q_and_k_by_default(model, ds, caplog):
    """auto: an fp8 cache gets Hadamard blocks over all D per layer and KV head (DS too: its
    labels and label scores stay unrotated), the model then stores K through ``forward`` (no
    fused RoPE store), and the startup line says so; none and a bf16 cache keep K as it is."""
    import logging
    from doublesparse.attention import k_rotation
    kw = dict(enable_double_sparsity=True, ds_heavy_token_num=16, ds_sparse_decode_threshold=0) if ds else {}
    with caplog.at_level(logging.INFO, logger="doublesparse"):
        e = engine(model, kv_cache_dtype="fp8_e4m3", **kw)
    b, c = e.parts.backend, model.config
    full = k_rotation.rotation_matrices(c.num_layers, c.num_kv_heads, c.head_dim)
    assert torch.equal(b.k_rotation, full[:, :1])   # one R for every head: one GEMM each for q and k
    assert not b.accepts_stored_kv
    assert any("q/K rotated" in r.getMessage() and "scales from default 1.0" in r.getMessage()
               for r in caplog.records)
    assert any(("labels and label scores unrotated" in r.getMessage()) == ds for r in caplog.records
               if "q/K rotated" in r.getMessage())
    assert engine(model, kv_cache_dtype="fp8_e4m3", kv_cache_k_rotation="none", **kw).parts.backend.k_rotation is None
    assert engine(model, kv_cache_dtype="bf16", **kw).parts.backend.k_rotation is None


@pytest.mark.parametrize("ds", [False, True])
def test_rotation_over_a_float32_cache_keeps_the_tokens(model, ds):
    """The rotation leaves every score unchanged: over the model's float32 cache it gives the
    unrotated engine's greedy tokens (dense and Double Sparsity: the same selection)."""
    kw = dict(enable_double_sparsity=True, ds_heavy_token_num=16, ds_sparse_decode_threshold=0) if ds else {}
    ps = prompts(3, seed=5)
    sp = {**GREEDY, "max_new_tokens": 8}
    base = engine(model, **kw).generate(ps, sp)
    e = engine(model, kv_cache_k_rotation="hadamard", **kw)
    assert e.parts.backend.k_rotation is not None
    assert [r["token_ids"] for r in e.generate(ps, sp)] == [r["token_ids"] for r in base]


@pytest.mark.parametrize("mode", ["group_max", "layer"])
def test_rotation_keeps_the_selection_and_the_sampled_recall(model, mode):
    """Double Sparsity's labels and label scores stay unrotated under the q/K rotation: over the
    float32 cache, prompts prefilled in chunks (labels written at prefill) then decoded sparsely
    give the unrotated engine's tokens, and the recall probe (its PyTorch re-selection reads the
    unrotated q) measures the same recall."""
    kw = dict(enable_double_sparsity=True, ds_heavy_token_num=16, ds_sparse_decode_threshold=0,
              ds_recall_sample_interval=1, ds_selection_mode=mode, chunked_prefill_size=32)
    ps = prompts(3, seed=7, lo=40, hi=120)
    sp = {**GREEDY, "max_new_tokens": 6}
    got = {}
    for rot in ("none", "hadamard"):
        e = engine(model, kv_cache_k_rotation=rot, **kw)
        assert (e.parts.backend.k_rotation is None) == (rot == "none")
        toks = [r["token_ids"] for r in e.generate(ps, sp)]
        got[rot] = toks, e.parts.recall.summary()
    assert got["hadamard"][0] == got["none"][0]
    a, b = got["hadamard"][1], got["none"][1]
    assert a["sampled_steps"] == b["sampled_steps"] > 0
    for key, val in b.items():
        if isinstance(val, float):
            assert a[key] == pytest.approx(val, abs=1e-4), key
