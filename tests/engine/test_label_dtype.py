"""The label pool's dtype: ``--ds-label-dtype auto`` (the default) resolves per device, and the
pools, the byte counts and the automatic dense/sparse choice all follow the resolved dtype."""

import argparse
from types import SimpleNamespace

import pytest
import torch

from doublesparse.attention.decode_choice import sparse_from
from doublesparse.config import EngineConfig
from doublesparse.config_flags import add_cli_args, from_cli_args
from doublesparse.engine.memory import plan_memory
from doublesparse.engine.ds_setup import ds_params

# Llama-3.1-8B's attention shapes
LLAMA = SimpleNamespace(num_layers=32, num_kv_heads=8, head_dim=128)
CUDA = torch.device("cuda")


def _gpu(monkeypatch, capability, hip=None):
    """Pretend ``cuda`` is a GPU of ``capability`` (no GPU is touched: only the query is)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)


@pytest.mark.parametrize("capability, hip, want", [
    ((9, 0), None, "fp8"), ((8, 9), None, "fp8"), ((10, 0), None, "fp8"),
    ((8, 6), None, "bf16"), ((8, 0), None, "bf16"), ((9, 4), "6.2", "bf16"),
])
def test_auto_label_dtype_per_gpu(monkeypatch, capability, hip, want):
    _gpu(monkeypatch, capability, hip)
    cfg = EngineConfig()
    assert cfg.ds_label_dtype == "auto"
    assert cfg.label_dtype_for(CUDA) == want == cfg.label_dtype_for("cuda:0")
    assert cfg.label_dtype_for(CUDA, k_bias=True) == "bf16"  # a K bias (Qwen2): bf16 under auto
    # an explicit dtype is kept on every device
    for d in ("bf16", "fp8"):
        assert EngineConfig(ds_label_dtype=d).label_dtype_for(CUDA) == d
        assert EngineConfig(ds_label_dtype=d).label_dtype_for(CUDA, k_bias=True) == d


def test_auto_label_dtype_on_cpu_and_flags():
    assert EngineConfig().label_dtype_for("cpu") == "bf16"
    assert EngineConfig(ds_label_dtype="fp8").label_dtype_for(torch.device("cpu")) == "fp8"
    p = add_cli_args(argparse.ArgumentParser())
    assert from_cli_args(p.parse_args([])).ds_label_dtype == "auto"
    for v in ("auto", "bf16", "fp8"):
        assert from_cli_args(p.parse_args(["--ds-label-dtype", v])).ds_label_dtype == v
    with pytest.raises(SystemExit):
        p.parse_args(["--ds-label-dtype", "fp16"])
    with pytest.raises(ValueError, match="ds_label_dtype"):
        EngineConfig(ds_label_dtype="int8")


@pytest.mark.parametrize("label, want_dtype, esize", [
    ("auto", torch.float8_e4m3fn, 1), ("bf16", torch.bfloat16, 2), ("fp8", torch.float8_e4m3fn, 1)])
def test_pools_bytes_and_cost_model_follow_the_label_dtype(monkeypatch, label, want_dtype, esize):
    """On an H100/H200-class GPU the default pool holds fp8 labels; the memory plan, the step's
    byte count and the cost model of the automatic choice all count them at 1 byte."""
    _gpu(monkeypatch, (9, 0))
    cfg = EngineConfig(max_total_tokens=1000, ds_label_dtype=label)
    plan = plan_memory(cfg, LLAMA, torch.bfloat16, CUDA, max_ctx=131072, heavy_channel_num=16)
    assert plan.label_dtype == want_dtype
    assert plan.label_bytes_per_token == 32 * 8 * 16 * esize
    p = ds_params(cfg, plan, num_q_heads=32, device=CUDA)
    assert p.policy.cost.label_bytes_per_token == plan.label_bytes_per_token
    assert p.policy.cost.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    qwen2 = SimpleNamespace(**vars(LLAMA), attention_bias=True)
    biased = plan_memory(cfg, qwen2, torch.bfloat16, CUDA, max_ctx=131072, heavy_channel_num=16)
    assert biased.label_dtype == (torch.bfloat16 if label == "auto" else want_dtype)


def test_fp8_labels_move_the_automatic_choice_only_slightly(monkeypatch):
    """Fewer label bytes make sparse decode pay from slightly shorter lengths; with the tuning's
    H200 figures, the speedup map's 'dense' cells (1 x 4K-16K, 4 x 4K, over their 24 decode
    steps) stay dense and one request decodes sparsely from below 32K."""
    _gpu(monkeypatch, (9, 0))
    starts = {}
    for label in ("bf16", "fp8"):
        cfg = EngineConfig(max_total_tokens=1000, ds_label_dtype=label)
        plan = plan_memory(cfg, LLAMA, torch.bfloat16, CUDA, max_ctx=131072, heavy_channel_num=16)
        policy = ds_params(cfg, plan, 32, CUDA).policy
        starts[label] = sparse_from(policy, 131072)
        assert not policy.plan([4096 + 24] * 4)[1] and policy.plan([4096] * 8)[1]
    assert (starts["fp8"], starts["bf16"]) == (17134, 17747)
    assert 16384 + 24 < starts["fp8"] < starts["bf16"] < 32768
