"""Channel-config format: round trip, foreign (SGLang / DoubleSparse) configs on GQA, refusals."""

import json
from dataclasses import dataclass

import pytest
import torch

from doublesparse import channels as ch
from doublesparse.channels import default_channels, rope_pairs
from doublesparse.testing import random_channel_stats, tiny_llama


@dataclass(frozen=True)
class Cfg:
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    name: str = "m"


LLAMA8B = Cfg(32, 32, 8, 128, "llama-3.1-8b")


def _perm_rows(g, rows, d):
    return [torch.randperm(d, generator=g).tolist() for _ in range(rows)]


def sglang_config(c=LLAMA8B, seed=0):
    """What the DoubleSparse repo ships for Llama-3.1-8B: q/qk 32x128, k 8x128, no metadata."""
    g = torch.Generator().manual_seed(seed)
    cfg = {}
    for i in range(c.num_layers):
        cfg[f"model.layers.{i}.self_attn.q_proj"] = _perm_rows(g, c.num_q_heads, c.head_dim)
        cfg[f"model.layers.{i}.self_attn.k_proj"] = _perm_rows(g, c.num_kv_heads, c.head_dim)
        cfg[f"model.layers.{i}.self_attn.qk_proj"] = _perm_rows(g, c.num_q_heads, c.head_dim)
    return cfg


def test_round_trip(tmp_path):
    c = Cfg(3, 6, 2, 16)
    s = random_channel_stats(c)
    p = ch.save_config(ch.stats_to_config(s, {"model": "m"}), tmp_path / "c.json")
    raw = json.loads(p.read_text())
    assert raw[ch.META_KEY]["model"] == "m"
    assert len(raw["model.layers.0.self_attn.q_proj"]) == 6
    assert len(raw["model.layers.0.self_attn.k_proj"]) == 2
    for mode in ch.MODES:
        got = ch.load_channels(p, c, "k", 5, mode)
        assert got.shape == (3, 2, 5) and got.dtype == torch.long
        assert torch.equal(got, s["k"].sort(-1, descending=True).indices[..., :5])
    # group aggregates are used for q/qk: sum for group_sum/per_head, max for group_max
    assert torch.equal(ch.load_channels(p, c, "qk", 4, "group_sum"),
                       s["qk_kv"].sort(-1, descending=True).indices[..., :4])
    assert torch.equal(ch.load_channels(p, c, "qk", 4, "group_max"),
                       s["qk_kvmax"].sort(-1, descending=True).indices[..., :4])
    assert torch.equal(ch.load_channels(p, c, "q", 4, "per_head"),
                       s["q_kv"].sort(-1, descending=True).indices[..., :4])


@pytest.mark.parametrize("mode", ch.MODES)
@pytest.mark.parametrize("ctype", ch.CHANNEL_TYPES)
def test_sglang_llama8b_on_gqa(tmp_path, mode, ctype):
    p = tmp_path / "llama.json"
    cfg = sglang_config()
    p.write_text(json.dumps(cfg))
    got = ch.load_channels(p, LLAMA8B, ctype, 16, mode)
    assert got.shape == (32, 8, 16)
    assert bool((got >= 0).all() and (got < 128).all())
    assert all(len(set(row.tolist())) == 16 for row in got.reshape(-1, 16))
    if ctype == "k":
        assert got[5, 3].tolist() == cfg["model.layers.5.self_attn.k_proj"][3][:16]


def test_group_rule_agreeing_heads():
    # every head of a group ranks the same way -> the group keeps that ranking, in every mode
    d = 8
    rows = torch.tensor([[3, 1, 4, 0, 5, 2, 7, 6]] * 4 + [[7, 6, 5, 4, 3, 2, 1, 0]] * 4)
    for mode in ch.MODES:
        r = ch.group_ranking(rows, 2, d, mode)
        assert r[0].tolist() == rows[0].tolist() and r[1].tolist() == rows[4].tolist()


def test_group_max_keeps_a_heads_favourite():
    # one head loves channel 7 (rank 0); three heads put it last: max keeps it on top, sum does not
    d = 8
    base = [0, 1, 2, 3, 4, 5, 6, 7]
    fav = [7, 0, 1, 2, 3, 4, 5, 6]
    rows = torch.tensor([fav, base, base, base])
    assert 7 in ch.group_ranking(rows, 1, d, "group_max")[0, :2].tolist()
    assert 7 not in ch.group_ranking(rows, 1, d, "group_sum")[0, :4].tolist()


def _write(tmp_path, cfg):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(cfg))
    return p


def test_refusals_name_key_and_shape(tmp_path):
    c = Cfg(2, 4, 2, 8)
    meta = {"model": "m", "num_layers": 2, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 8}
    good = ch.stats_to_config(random_channel_stats(c), meta)

    def expect(cfg, ctype, *words, r=4, model=c):
        with pytest.raises(ValueError) as e:
            ch.load_channels(_write(tmp_path, cfg), model, ctype, r, "group_sum")
        for w in words:
            assert w in str(e.value), (w, str(e.value))

    # layer count
    expect(good, "k", "2 layers", "model.layers.0..2", model=Cfg(3, 4, 2, 8))
    # head count: the config's q rows (4) do not fit a model with 8 query heads
    bad = {k: v for k, v in good.items() if k != ch.META_KEY}
    expect(bad, "qk", "model.layers.0.self_attn.qk_proj", "[8][8]", model=Cfg(2, 8, 2, 8))
    expect(bad, "k", "model.layers.0.self_attn.k_proj", "[4][8]", model=Cfg(2, 8, 4, 8))
    # head_dim
    expect(bad, "k", "model.layers.0.self_attn.k_proj", "[2][4]", model=Cfg(2, 4, 2, 4))
    # missing key
    miss = dict(bad)
    del miss["model.layers.1.self_attn.k_proj"]
    expect(miss, "k", "model.layers.1.self_attn.k_proj", "[2][8]")
    # out of range
    oor = json.loads(json.dumps(bad))
    oor["model.layers.1.self_attn.qk_proj"][2][0] = 8
    oor.pop("model.layers.1.self_attn.qk_proj_kv")
    expect(oor, "qk", "model.layers.1.self_attn.qk_proj", "[4][8]", "out of range")
    # repeated
    rep = json.loads(json.dumps(bad))
    rep["model.layers.0.self_attn.k_proj"][1][3] = rep["model.layers.0.self_attn.k_proj"][1][0]
    expect(rep, "k", "model.layers.0.self_attn.k_proj", "[2][8]", "repeats")
    # metadata disagreeing with the model
    expect(good, "k", "num_kv_heads", model=Cfg(2, 4, 4, 8))
    # more heavy channels than head_dim
    expect(good, "k", "heavy_channel_num", r=9)


def test_packaged_path():
    assert ch.packaged_config_path("unknown-model") is None
    assert ch.packaged_config_path(None) is None
    p = ch.packaged_config_path("Smollm2 135M 8k Lc100K Mix1 Ep2")
    assert p == ch.packaged_config_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    if p is not None:
        assert p.name == "smollm2-135m-instruct.json"
        cfg = ch.read_config(p)
        meta = cfg[ch.META_KEY]
        sm = Cfg(meta["num_layers"], meta["num_q_heads"], meta["num_kv_heads"], meta["head_dim"], meta["model"])
        assert ch.load_channels(p, sm, "qk", 16, "group_max").shape == (30, 3, 16)


def test_rope_pairs():
    assert rope_pairs(8).tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    assert rope_pairs(8, interleaved=True).tolist() == [1, 0, 3, 2, 5, 4, 7, 6]


def test_default_channels_from_weights():
    m = tiny_llama()
    c = m.config
    with torch.no_grad():  # make channel 3 (and its RoPE partner 11) of KV head 1 dominant
        m.layers[0].attn.qkv_proj.weight[c.q_size + 1 * 16 + 3] *= 50   # rows: q | k | v
    for t in ("q", "k", "qk"):
        got = default_channels(m, 4, t)
        assert got.shape == (c.num_layers, c.num_kv_heads, 4)
        assert all(len(set(row.tolist())) == 4 for row in got.reshape(-1, 4))
    got = default_channels(m, 4)
    assert got[0, 1, 0] == 3 and got[0, 1, 1] == 11   # the pair stays together, larger row first
    with pytest.raises(ValueError, match="heavy_channel_num"):
        default_channels(m, 17)
