"""Selection recall: the vectorised measure against a per-position loop, the choice rule, and a
calibration of a tiny GQA model with 7 query heads per KV head recording its per-layer modes."""

import math

import pytest
import torch

from doublesparse import channels as ch
from doublesparse.calibrate.pipeline import build_config
from doublesparse.calibrate.recall import (
    captured_mass,
    choose_modes,
    decode_positions,
    kept_windows,
)
from doublesparse.config import EngineConfig
from doublesparse.testing import ByteTokenizer, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def _loop_mass(q, k, positions, channels, mode, ratio=1 / 16):
    """One position and query head at a time, as the engine's reference selects."""
    P, hq, D = q.shape
    hkv = k.shape[1]
    G = hq // hkv
    got = torch.zeros(P, hq)
    for i, p in enumerate(positions.tolist()):
        n = p + 1
        kp = max(1, math.ceil(ratio * n))
        sink, recent = EngineConfig().sink_recent(kp)
        kk = k[:n].float()
        est = torch.stack([q[i, h, channels[h // G]] @ kk[:, h // G, channels[h // G]].T for h in range(hq)])
        if mode != "per_head":
            red = est.view(hkv, G, n).sum(1) if mode == "group_sum" else est.view(hkv, G, n).amax(1)
            est = red.repeat_interleave(G, 0)
        est[:, :sink] = float("inf")
        est[:, n - recent:] = float("inf")
        for h in range(hq):
            prob = (kk[:, h // G] @ q[i, h] / math.sqrt(D)).softmax(-1)
            got[i, h] = prob[est[h].topk(kp).indices].sum()
    return got


@pytest.mark.parametrize("mode", ch.MODES)
def test_captured_mass_matches_loop(mode):
    g = torch.Generator().manual_seed(3)
    T, hq, hkv, D, r = 203, 7, 1, 12, 5
    q, k = torch.randn(T, hq, D, generator=g), torch.randn(T, hkv, D, generator=g) * 2
    pos = decode_positions(T, 9)
    chans = torch.stack([torch.randperm(D, generator=g)[:r] for _ in range(hkv)])
    got, best = captured_mass(q[pos], k, pos, chans, mode)
    torch.testing.assert_close(got, _loop_mass(q[pos], k, pos, chans, mode), rtol=1e-4, atol=1e-5)
    assert bool((got <= best + 1e-5).all()) and bool((best <= 1 + 1e-5).all())


def test_decode_positions_and_kept_windows():
    p = decode_positions(64, 8)
    assert p.min() >= 32 and p.max() == 63 and len(p) == 8
    assert kept_windows(12, 4) == {0, 3, 6, 9} and kept_windows(3, 5) == {0, 1, 2} and kept_windows(5, 0) == set()


def test_choose_modes_needs_a_material_gain():
    # missed mass: group_max 0.2 / 0.1 / 0.3; group_sum 15 % less in layer 0, 5 % less in layer 2
    rec = {"group_sum": [0.83, 0.5, 0.715], "group_max": [0.8, 0.9, 0.7]}
    got = choose_modes(rec)
    assert got == {"model_mode": "group_max", "per_layer": ["group_sum", "group_max", "group_max"]}
    assert choose_modes(rec, rel_margin=0.0)["per_layer"] == ["group_sum", "group_max", "group_sum"]
    # a mode far ahead on average becomes the model's mode, layers keep a material exception
    wide = {"group_sum": [0.9, 0.9, 0.5], "group_max": [0.5, 0.5, 0.9]}
    assert choose_modes(wide) == {"model_mode": "group_sum", "per_layer": ["group_sum", "group_sum", "group_max"]}
    assert choose_modes({**rec, "per_head": [1.0] * 3})["model_mode"] == "group_max"  # not a candidate
    assert choose_modes({**rec, "per_head": [1.0] * 3}, candidates=("per_head", "group_max"))["model_mode"] == "per_head"
    with pytest.raises(ValueError, match="candidate"):
        choose_modes({"per_head": [1.0]})


def test_calibration_records_modes_for_a_wide_group():
    """7 query heads per KV head (as Qwen2.5-0.5B): every layer gets a mode, the meta has each
    mode's recall per layer, and the chosen modes' recall is the best per layer."""
    m = tiny_llama(num_layers=3, num_q_heads=14, num_kv_heads=2, hidden_size=56, head_dim=16,
                   max_position_embeddings=256)
    g = torch.Generator().manual_seed(5)
    text = bytes(torch.randint(32, 127, (6 * 200,), generator=g).tolist()).decode()
    cfg = build_config(m, ByteTokenizer(), [text], num_samples=6, seq_len=200, progress=False, recall_samples=2)
    modes = ch.recorded_modes(cfg, 3)
    sel = cfg[ch.META_KEY]["selection"]
    assert list(cfg)[-1] == ch.META_KEY and sel["recall_samples"] == 2 and sel["per_layer"] == list(modes)
    assert list(modes) == choose_modes(sel["recall"])["per_layer"]
    for i, mode in enumerate(modes):
        assert mode in ("group_sum", "group_max") and 0 < sel["recall"][mode][i] <= sel["oracle"][i] + 1e-4
    assert ch.parse_channels(cfg, m.config, "qk", 4, modes).shape == (3, 2, 4)
    none = build_config(m, ByteTokenizer(), [text], num_samples=2, seq_len=200, progress=False, recall_samples=0)
    assert ch.recorded_modes(none, 3) is None and "selection" not in none[ch.META_KEY]
