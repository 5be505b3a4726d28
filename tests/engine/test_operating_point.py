"""The operating point: the shape rule, reading a calibrated one from a channel config, which
fields it fills and which flags override it, and the engine running and reporting it."""

import argparse

import pytest

from doublesparse import channels as ch
from doublesparse.config import EngineConfig
from doublesparse.config_flags import add_cli_args, from_cli_args
from doublesparse.engine import Engine
from doublesparse.engine import operating_point as op
from doublesparse.testing import ByteTokenizer, random_channel_config, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def _point(**chosen):
    c = {"ds_heavy_channel_num": 4, "ds_heavy_token_ratio": 0.125, "ds_heavy_token_min": 24,
         "ds_selection_mode": "group_sum", "ds_num_sink": 2, "ds_num_recent": 8, "ds_budget_top_p": 0.0,
         "kl": 0.01, "top1": 0.9, "bytes_fraction": 0.3}
    c.update(chosen)
    return {"version": 1, "kl_target": 0.015, "target_met": True, "chosen": c,
            "measured_on": {"seq_len": 512}, "frontier": []}


@pytest.mark.parametrize("hq,hkv,d,want", [
    (9, 3, 64, (16, 1 / 16, 512, "group_max")),      # SmolLM2-135M: query group 3
    (12, 2, 128, (32, 1 / 4, 2048, "group_max")),    # Qwen2.5-Coder-1.5B: group 6
    (14, 2, 64, (16, 1 / 4, 2048, "group_sum")),     # Qwen2.5-0.5B: group 7
    (32, 8, 128, (16, 1 / 16, 512, "group_max")),    # Llama-3.1-8B: group 4 (r capped at 16)
    (4, 2, 16, (4, 1 / 16, 512, "group_max")),
])
def test_shape_default(hq, hkv, d, want):
    p = op.shape_default(hq, hkv, d)
    assert (p.heavy_channel_num, p.token_ratio, p.token_min, p.selection) == want
    assert p.source == "shape default" and p.sink_recent == (4, 32)
    assert f"query group {hq // hkv}" in p.describe()


def test_mla_keeps_the_former_defaults():
    p = op.shape_default(16, 1, 576, latent=True)              # DeepSeek-V2-Lite's latent rows
    assert (p.heavy_channel_num, p.token_ratio, p.token_min, p.selection) == (16, 1 / 16, 512, "group_max")


def test_from_config_reads_and_refuses():
    p = op.from_config({op.OP_KEY: _point()}, 2, 16)
    assert (p.source, p.heavy_channel_num, p.token_ratio, p.token_min, p.selection) == ("calibrated", 4, 0.125, 24,
                                                                                         "group_sum")
    assert p.modes(2) == ("group_sum", "group_sum") and p.kl_target == 0.015 and p.measured["seq_len"] == 512
    assert op.from_config({}, 2, 16) is None
    per = op.from_config({op.OP_KEY: _point(ds_selection_mode="per_layer")}, 2, 16, ("group_max", "group_sum"))
    assert per.modes(2) == ("group_max", "group_sum")
    for bad, field in (({"ds_heavy_channel_num": 32}, "ds_heavy_channel_num"),      # > head_dim
                       ({"ds_heavy_token_ratio": 0}, "ds_heavy_token_ratio"),
                       ({"ds_heavy_token_min": 1.5}, "ds_heavy_token_min"),
                       ({"ds_selection_mode": "mean"}, "ds_selection_mode"),
                       ({"ds_selection_mode": "per_layer"}, "per_layer")):            # no ds_mode keys
        with pytest.raises(ValueError, match=field):
            op.from_config({op.OP_KEY: _point(**bad)}, 2, 16)
    with pytest.raises(ValueError, match="'chosen'"):
        op.from_config({op.OP_KEY: {"kl_target": 0.1}}, 2, 16)


def _flags(*argv):
    return from_cli_args(add_cli_args(argparse.ArgumentParser()).parse_args(list(argv)))


def test_flags_override_the_point_field_by_field():
    p = op.from_config({op.OP_KEY: _point(ds_budget_top_p=0.9)}, 2, 16)
    filled = p.fill(_flags())
    assert (filled.ds_heavy_channel_num, filled.ds_heavy_token_ratio, filled.ds_heavy_token_min) == (4, 0.125, 24)
    assert filled.budget_mode == "top_p" and filled.ds_budget_top_p == 0.9
    assert filled.ds_num_sink is None  # left unset: scaled to small budgets by sink_recent(k, point's)
    assert filled.sink_recent(16, p.sink_recent) == (2, 4) and filled.sink_recent(512, p.sink_recent) == (2, 8)
    user = _flags("--ds-heavy-channel-num", "8", "--ds-heavy-token-min", "64", "--ds-budget-mode", "ratio",
                  "--ds-selection-mode", "group_max")
    got = p.fill(user)
    assert (got.ds_heavy_channel_num, got.ds_heavy_token_ratio, got.ds_heavy_token_min) == (8, 0.125, 64)
    assert got.budget_mode == "ratio"
    assert p.overridden(user) == {"ds_heavy_channel_num": 8, "ds_heavy_token_min": 64,
                                  "ds_selection_mode": "group_max", "ds_budget_mode": "ratio"}
    assert p.fill(_flags("--enable-ds-offload")).budget_mode == "ratio"     # offload runs no top-p
    fixed = p.fill(_flags("--ds-heavy-token-num", "100"))      # a fixed k keeps the fixed budget
    assert fixed.budget_mode == "fixed" and fixed.token_budget(4096).k_max == 100
    assert EngineConfig().token_budget(8192).k_min == 512    # unset and unfilled: the old fallbacks


def _engine(model, **kw):
    kw.setdefault("max_total_tokens", 2048)
    kw.setdefault("max_running_requests", 4)
    return Engine(model=model, tokenizer=ByteTokenizer(), progress=False, enable_double_sparsity=True,
                  attention_backend="torch", **kw)


def test_engine_runs_and_reports_the_calibrated_point(tmp_path):
    model = tiny_llama(seed=1, max_position_embeddings=512)
    cfg = random_channel_config(model.config, ["group_sum", "group_sum"])
    cfg[op.OP_KEY] = _point()
    path = ch.save_config(cfg, tmp_path / "c.json")
    e = _engine(model, ds_channel_config_path=str(path))
    pt = e.operating_point
    assert pt["source"] == "calibrated" and pt["kl_target"] == 0.015 and pt["overridden"] == {}
    assert "calibrated" in pt["summary"] and "KL 0.0100" in pt["summary"]
    assert e.parts.memory.plan.heavy_channel_num == 4
    b = e.parts.ds.policy.budget
    assert (b.ratio, b.k_min, b.k_max) == (0.125, 24, 64)       # k_max: ratio x 512 tokens of context
    assert e.parts.ds.mode == "group_sum" and (e.parts.ds.num_sink, e.parts.ds.num_recent) == (2, 6)
    e2 = _engine(model, ds_channel_config_path=str(path), ds_heavy_channel_num=8, ds_num_recent=4)
    assert e2.parts.memory.plan.heavy_channel_num == 8 and e2.parts.ds.num_recent == 4
    assert e2.operating_point["overridden"] == {"ds_heavy_channel_num": 8, "ds_num_recent": 4}


def test_engine_without_config_takes_the_shape_default():
    wide = tiny_llama(seed=2, num_layers=2, num_q_heads=14, num_kv_heads=2, hidden_size=56, head_dim=16,
                      max_position_embeddings=512)
    e = _engine(wide)
    pt = e.operating_point
    assert pt["source"] == "shape default" and pt["selection"] == "group_sum" and "query group 7" in pt["rule"]
    assert e.parts.ds.mode == "group_sum" and e.parts.ds.policy.budget.ratio == 1 / 4
    assert Engine(model=wide, tokenizer=ByteTokenizer(), progress=False,
                  max_total_tokens=1024).operating_point is None          # Double Sparsity off
