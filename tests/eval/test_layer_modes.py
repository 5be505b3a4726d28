"""Eval of a setting with per-layer selection modes (a calibrated config's ``ds_mode`` keys): its
name, bytes, channels, and that each layer decodes with its own mode."""

import argparse

import pytest
import torch

from doublesparse import channels as ch
from doublesparse.eval import cli, driver
from doublesparse.eval.settings import Setting, default_setting
from doublesparse.kernels import ops
from doublesparse.testing import random_channel_config, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(c, modes):
    return random_channel_config(c, modes)


def test_default_setting_follows_recorded_modes():
    assert default_setting(64).layer_modes == () and default_setting(64).mode == "group_max"
    same = default_setting(64, layer_modes=("group_sum",) * 3)
    assert same.mode == "group_sum" and same.layer_modes == () and "/group_sum/" in same.name
    mixed = default_setting(64, layer_modes=("group_sum", "per_head", "group_sum"))
    assert mixed.mode_of(1) == "per_head" and "/layer_modes/" in mixed.name
    # bytes: the per_head layer reads Hq rows of selected K/V, the others Hkv
    flat = Setting("ds", "qk", "group_sum", 16, 1 / 16)
    ph = Setting("ds", "qk", "per_head", 16, 1 / 16)
    lm = Setting("ds", "qk", "group_sum", 16, 1 / 16, layer_modes=("group_sum", "per_head", "group_sum"))
    dims = (3, 9, 3, 64)
    b = [s.bytes_per_step(4096, *dims) for s in (flat, ph, lm)]
    assert b[0] < b[2] < b[1] and b[2] - b[0] == (b[1] - b[0]) // 3


def test_layer_modes_reach_channels_and_decode(tmp_path, monkeypatch):
    m = tiny_llama(max_position_embeddings=256)
    c = m.config
    modes = ("per_head", "group_sum")
    path = ch.save_config(_config(c, modes), tmp_path / "c.json")
    args = argparse.Namespace(channels=str(path))
    assert cli.recorded_layer_modes(args, m) == modes
    s = Setting("ds", "qk", "group_max", 4, 1 / 4, layer_modes=modes)
    channels_for, _ = cli.channel_source(args, m)
    assert torch.equal(channels_for(s), ch.load_channels(path, c, "qk", 4, modes))
    seen = []
    real = ops.ds_decode
    monkeypatch.setattr(ops, "ds_decode", lambda *a, **kw: seen.append(a[10].mode) or real(*a, **kw))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (1, 60), generator=g).tolist()
    p = driver.Pools(c, 1, 60)
    driver.prefill(m, p, [x[:40] for x in ids])
    p.relabel(channels_for(s))
    driver.decode_tokens(m, p, s, channels_for(s), [x[40:42] for x in ids], 8)
    assert seen[:2] == list(modes)
