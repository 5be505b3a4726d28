"""Choosing the operating point: the cheapest measured point under the KL target, its
tie-breaks, the staged search (on a fake measurement), held-apart windows, and the record
written into a channel config and read back by the engine (a tiny model end to end)."""

import argparse
import json
from dataclasses import replace

import pytest

from doublesparse import channels as ch
from doublesparse.calibrate import cli
from doublesparse.calibrate import frontier as fr
from doublesparse.engine import operating_point as op
from doublesparse.eval.settings import Setting
from doublesparse.testing import ByteTokenizer, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def _m(name, b, kl, top1=0.9):
    return fr.Measured(Setting("ds", "qk", "group_max", 16, 1 / 16, num_sink=int(b * 1000)), name, b, kl, top1, 0.0)


def test_cheapest_under_target_and_tie_breaks():
    a, b, c = _m("a", 0.2, 0.010), _m("b", 0.1, 0.014), _m("c", 0.05, 0.05)
    assert fr.cheapest_under([a, b, c], 0.015) == (b, True)
    same = _m("d", 0.1, 0.012)                       # equal bytes: the lower KL
    assert fr.cheapest_under([a, b, same, c], 0.015)[0] is same
    t1, t2 = _m("e", 0.1, 0.012, 0.80), _m("f", 0.1, 0.012, 0.95)
    assert fr.cheapest_under([t1, t2], 0.015)[0] is t2   # then the higher top-1
    assert fr.cheapest_under([a, b, c], 0.001) == (a, False)   # none under: the lowest KL
    with pytest.raises(ValueError):
        fr.cheapest_under([], 0.01)


def _fake(dims=64):
    """KL falls with r and k, group_sum and 8 sink / 64 recent do better; top-p at 0.9 keeps 40 %
    of its upper bound (fewer tokens than the fixed point), at 0.95 60 % (more), both under the target."""
    seen = []

    def frac(s, k=None):
        return s.r / (2 * dims) + (k / 4096 if k is not None else s.k_frac)

    def measure(s, stage):
        seen.append((s, stage))
        kl = 0.002 / (s.r / 16 * s.k_frac * 16) ** 1.5 * (0.7 if s.mode == "group_sum" else 1.0)
        kl *= 0.9 if s.num_recent == 64 else 1.0
        avg_k = None
        if s.top_p:
            avg_k = (0.4 if s.top_p == 0.9 else 0.6) * s.k_for(4096)
            kl = 0.009
        return fr.Measured(s, stage, frac(s, avg_k), kl, 0.9, 100 * kl, avg_k)

    return measure, frac, seen


def test_search_stages_on_a_fake_measurement():
    measure, frac, seen = _fake()
    opts = fr.OpSettings(kl_target=0.01, seq_len=4096)
    chosen, met, measured = fr.search(measure, frac, 64, 4096, ("group_max", "group_sum"), opts)
    stages = [st for _, st in seen]
    assert stages[:6] == ["selection"] * 6       # 3 selections (recall's mix included) x 2 sink/recent
    first = [s for s, st in seen if st == "selection"]
    assert {s.layer_modes for s in first} == {(), ("group_max", "group_sum")}
    budget = [s for s, st in seen if st == "budget"]
    assert all(s.mode == "group_sum" and s.num_recent == 64 for s in budget)   # stage 1's best
    assert [frac(s) for s in budget] == sorted(frac(s) for s in budget)        # cheapest first
    # stopped at the first bytes level under the target: nothing dearer was measured
    level = min(frac(s) for s in budget if measure(s, "x").kl <= 0.01)
    assert max(frac(s) for s in budget) == pytest.approx(level)
    # top-p at 0.9 reads fewer bytes at a KL under the target, so it wins
    assert met and chosen.setting.top_p == 0.9 and chosen.stage == "top_p"
    fixed, _ = fr.cheapest_under([x for x in measured if not x.setting.top_p], 0.01)
    tops = [s for s, st in seen if st == "top_p"]
    assert [s.top_p for s in tops] == list(fr.TOP_PS)
    assert all(s.k_frac == 2 * fixed.setting.k_frac and s.top_p_min == fixed.setting.k_for(4096) // 2
               for s in tops)
    full_measure, full_frac, full_seen = _fake()
    fr.search(full_measure, full_frac, 64, 4096, None, replace(opts, full_grid=True))
    assert sum(st == "budget" for _, st in full_seen) == 12 - 1   # r 8/16/32 x 4 ratios, one measured in stage 1


def test_held_apart_windows_miss_the_statistics_windows():
    used = [(0, 100), (300, 400), (700, 800)]
    starts = fr.held_apart_windows(1000, used, 100, 3)
    assert len(starts) == 3 and starts == sorted(starts)
    for s in starts:
        assert all(s + 100 <= a or s >= b for a, b in used) and s + 100 <= 1000
    with pytest.raises(ValueError, match="held-apart"):
        fr.held_apart_windows(1000, used, 250, 2)


def test_calibration_writes_a_point_the_engine_reads(tmp_path):
    txt = tmp_path / "t.txt"
    txt.write_text("Now is the winter of our discontent made glorious summer by this sun of York. " * 40)
    m = tiny_llama(max_position_embeddings=256)
    args = argparse.Namespace(model_path=None, output=str(tmp_path / "cfg.json"), text=[str(txt)], num_samples=3,
                              seq_len=64, device="cpu", quiet=True, op_seq_len=256, op_windows=1,
                              op_decode_len=12, op_kl_target=0.5)
    cli.run(args, model=m, tokenizer=ByteTokenizer())
    raw = json.loads((tmp_path / "cfg.json").read_text())
    rec = raw[op.OP_KEY]
    assert list(raw)[-2:] == [op.OP_KEY, ch.META_KEY]                 # the meta stays last
    assert rec["kl_target"] == 0.5 and rec["frontier"] and rec["measured_on"]["seq_len"] == 256
    c = rec["chosen"]
    point = op.from_config(raw, 2, 16, ch.recorded_modes(raw, 2))
    assert point.heavy_channel_num == c["ds_heavy_channel_num"] and point.kl_target == 0.5
    assert point.measured["kl"] == c["kl"] and point.source == "calibrated"
    want = c["ds_selection_mode"]
    assert set(ch.recorded_modes(raw, 2)) <= ({want} if want != "per_layer" else {"group_sum", "group_max"})
    # the rankings other readers use are untouched by the new keys
    assert ch.load_channels(tmp_path / "cfg.json", m.config, "qk", 4, "group_sum").shape == (2, 2, 4)
    # --from-config keeps the rankings and measures the point again
    args2 = argparse.Namespace(**{**vars(args), "output": str(tmp_path / "again.json"),
                                  "from_config": str(tmp_path / "cfg.json"), "op_kl_target": 0.25})
    cli.run(args2, model=m, tokenizer=ByteTokenizer())
    again = json.loads((tmp_path / "again.json").read_text())
    assert again[op.OP_KEY]["kl_target"] == 0.25
    assert all(again[k] == raw[k] for k in raw if k.endswith(("_proj", "_kv", "_kvmax")))
