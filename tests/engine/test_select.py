"""Per-layer selection modes from a channel config, calibration on demand and its cache, and the
report of running without a calibrated config."""

import json
import logging
import os

import pytest
import torch

from doublesparse import channels as ch
from doublesparse.calibrate import on_demand
from doublesparse.api import Engine
from doublesparse.kernels import ops
from doublesparse.testing import ByteTokenizer, random_channel_config, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_POS = 256


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=1, max_position_embeddings=MAX_POS)


def engine(model, **kw):
    kw.setdefault("max_total_tokens", 2048)
    kw.setdefault("ds_sparse_decode_threshold", 0)
    kw.setdefault("max_running_requests", 4)
    return Engine(model=model, tokenizer=ByteTokenizer(), progress=False, enable_double_sparsity=True,
                  attention_backend="torch", **kw)


def _config(model, modes):
    return random_channel_config(model.config, modes)


def _spy(monkeypatch):
    seen = []
    real = ops.ds_decode

    def spy(*a, **kw):
        seen.append((a[10] if len(a) > 10 else kw["args"]).mode)  # its DSDecodeArgs' mode
        return real(*a, **kw)
    monkeypatch.setattr(ops, "ds_decode", spy)
    return seen


def test_recorded_modes_reach_each_layer(model, tmp_path, monkeypatch):
    modes = ["per_head", "group_sum"]
    p = ch.save_config(_config(model, modes), tmp_path / "c.json")
    seen = _spy(monkeypatch)
    e = engine(model, ds_channel_config_path=str(p), ds_heavy_token_num=16)
    assert e.parts.ds.layer_modes == tuple(modes) and e.stats()["channels_calibrated"] is True
    want = ch.load_channels(p, model.config, "qk", e.parts.memory.plan.heavy_channel_num, modes)
    assert torch.equal(e.parts.backend.channels.long().cpu(), want)
    e.generate([list(range(40, 90))], {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True})
    assert seen[:4] == modes * 2
    # bytes per step: the per_head layer reads Hq rows of K/V, the group_sum layer Hkv rows
    plan, n, k = e.parts.memory.plan, 200, 16
    row = 2 * plan.head_dim * plan.kv_dtype.itemsize * k
    want = n * plan.label_bytes_per_token + row * (model.config.num_q_heads + model.config.num_kv_heads)
    assert e.parts.backend.decode_bytes([n]) == want
    # an explicit mode overrides the recorded ones, on every layer
    seen.clear()
    e = engine(model, ds_channel_config_path=str(p), ds_heavy_token_num=16, ds_selection_mode="group_max")
    assert e.parts.ds.layer_modes == () and e.parts.ds.mode == "group_max"
    e.generate([list(range(40, 90))], {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True})
    assert set(seen) == {"group_max"}


def test_recorded_modes_refusals(model):
    cfg = _config(model, ["group_sum", "group_max"])
    assert ch.recorded_modes(cfg, 2) == ("group_sum", "group_max")
    with pytest.raises(ValueError, match="not for"):
        ch.recorded_modes({k: v for k, v in cfg.items() if k != ch.mode_key(1)}, 2)
    with pytest.raises(ValueError, match="ds_mode must be one of"):
        ch.recorded_modes({**cfg, ch.mode_key(0): "group_mean"}, 2)
    # per-layer rankings follow each layer's mode: the _kvmax aggregate for group_max only
    got = ch.parse_channels(cfg, model.config, "qk", 4, ("group_sum", "group_max"))
    assert got[0].tolist() == [r[:4] for r in cfg[ch.layer_key(0, "qk", "_kv")]]
    assert got[1].tolist() == [r[:4] for r in cfg[ch.layer_key(1, "qk", "_kvmax")]]


def test_uncalibrated_is_reported(model, caplog):
    with caplog.at_level(logging.WARNING, logger="doublesparse.engine"):
        e = engine(model, ds_heavy_token_num=16)
    assert e.stats()["channels_calibrated"] is False and "weight-based" in e.stats()["channel_source"]
    assert any("no calibrated channel config" in r.getMessage() for r in caplog.records)
    assert Engine(model=model, tokenizer=ByteTokenizer(), progress=False,
                  max_total_tokens=1024).stats()["channels_calibrated"] is None


def test_auto_calibrates_once_then_reads_the_cache(model, tmp_path, monkeypatch):
    monkeypatch.setenv("DOUBLESPARSE_CACHE", str(tmp_path / "cache"))
    plays = tmp_path / "plays"
    plays.mkdir()
    g = torch.Generator().manual_seed(2)
    from doublesparse.texts import CALIBRATION_PLAYS
    for name in CALIBRATION_PLAYS:  # 12 windows of 256 byte-tokens in all
        (plays / f"{name}.txt").write_bytes(bytes(torch.randint(32, 127, (600,), generator=g).tolist()))
    monkeypatch.setenv("DOUBLESPARSE_SHAKESPEARE_DIR", str(plays))
    e = engine(model, ds_channel_config_path="auto", ds_heavy_token_num=16)
    (cached,) = (tmp_path / "cache" / "channels").glob("*.json")
    raw = json.loads(cached.read_text())
    assert ch.recorded_modes(raw, 2) == e.parts.ds.layer_modes or (e.parts.ds.layer_modes == ()
                                                                    and len(set(ch.recorded_modes(raw, 2))) == 1)
    assert e.stats()["channels_calibrated"] and str(cached) in e.stats()["channel_source"]
    assert raw[ch.META_KEY]["command"] == "--ds-channel-config-path auto"
    monkeypatch.setattr(on_demand, "build_config", lambda *a, **k: pytest.fail("calibrated twice"))
    e2 = engine(model, ds_channel_config_path="auto", ds_heavy_token_num=16)
    assert torch.equal(e2.parts.backend.channels, e.parts.backend.channels)


def test_file_hash_is_remembered_by_size_and_mtime(tmp_path, monkeypatch):
    monkeypatch.setenv("DOUBLESPARSE_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc" * 1000)
    h = on_demand.file_sha256(f)
    st = f.stat()
    f.write_bytes(b"abd" * 1000)                     # same size; put the old mtime back
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert on_demand.file_sha256(f) == h             # remembered, not re-read
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert on_demand.file_sha256(f) != h
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"w")
    (d / "notes.txt").write_text("ignored")
    k1 = on_demand.model_sha256(d)
    (d / "notes.txt").write_text("changed")
    assert on_demand.model_sha256(d) == k1
