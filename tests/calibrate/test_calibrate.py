"""Calibration: statistics accumulate over every sample (not only the last), CLI writes a config."""

import argparse
import json

import pytest
import torch

from doublesparse import channels as ch
from doublesparse import texts
from doublesparse.calibrate import cli
from doublesparse.calibrate.threads import ThreadChooser, candidates_for, num_threads
from doublesparse.calibrate.stats import StatsAttention, collect_stats, make_batch, sample_windows
from doublesparse.models.simple_attention import causal_attention
from doublesparse.testing import ByteTokenizer, tiny_llama


class Capture:
    """Backend that keeps every layer's post-RoPE q, k and runs the plain causal attention."""

    def __init__(self):
        self.qs, self.ks = {}, {}
        self.inner = StatsAttention(1, 1, 1, 1).inner

    def forward(self, layer_id, q, k, v, batch):
        self.qs.setdefault(layer_id, []).append(q.double())
        self.ks.setdefault(layer_id, []).append(k.double())
        return self.inner.forward(layer_id, q, k, v, batch)


def test_stats_match_direct_computation():
    m = tiny_llama()
    c = m.config
    g = torch.Generator().manual_seed(1)
    windows = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 17, 33)]
    got = collect_stats(m, windows, progress=False)
    cap = Capture()
    with torch.no_grad():
        for w in windows:
            m(torch.tensor(w), torch.arange(len(w)), make_batch(cap, torch.tensor([len(w) - 1])))
    G = c.num_q_heads // c.num_kv_heads
    for i in range(c.num_layers):
        q, k = torch.cat(cap.qs[i]), torch.cat(cap.ks[i])           # every token of every sample
        assert q.shape[0] == 90 and int(got["tokens"][i]) == 90
        torch.testing.assert_close(got["q"][i], q.abs().mean(0))
        torch.testing.assert_close(got["k"][i], k.abs().mean(0))
        qk = (q * k.repeat_interleave(G, 1)).abs().mean(0)
        torch.testing.assert_close(got["qk"][i], qk)
        torch.testing.assert_close(got["qk_kv"][i], qk.view(c.num_kv_heads, G, -1).sum(1))
        torch.testing.assert_close(got["qk_kvmax"][i], qk.view(c.num_kv_heads, G, -1).amax(1))
    # the last sample alone (the reference bug) gives different numbers
    last = torch.cat(cap.ks[0][-1:]).abs().mean(0)
    assert not torch.allclose(got["k"][0], last)


def test_causal_attention_matches_explicit_softmax():
    """The 4-D (flash-kernel) path computes plain causal GQA attention."""
    g = torch.Generator().manual_seed(0)
    T, hq, hkv, D = 37, 6, 2, 16
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (hq, hkv, hkv))
    kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    s = torch.einsum("thd,shd->hts", q, kk) / D ** 0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hts,shd->thd", s.softmax(-1), vv)
    got = causal_attention(q, k, v)
    assert got.shape == (T, hq, D)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_thread_chooser_keeps_the_faster_count_and_rechecks():
    tc = ThreadChooser([1, 2], recheck=5)
    cost = {2: 3.0, 1: 1.0}                     # loaded machine: 1 thread is faster
    seen = []
    for i in range(10):
        n = tc.next()
        seen.append(n)
        if i == 4:
            cost[2] = 0.5                       # the load went away
        tc.record(n, cost[n] * 100, 100)
    # probe both, stay on 1, re-measure 2 at the 5th sample, then keep the now faster 2
    assert seen == [2, 1, 1, 1, 2, 2, 2, 2, 2, 1] and tc.chosen == seen
    one = ThreadChooser([3])
    assert [one.next() for _ in range(4)] == [3, 3, 3, 3]
    assert candidates_for(2, "cpu") == [2] and candidates_for(0, "cuda") == [torch.get_num_threads()]
    old = torch.get_num_threads()
    with num_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == old


def test_sample_windows():
    ids = list(range(100))
    w = sample_windows(ids, 3, 20)
    assert [x[0] for x in w] == [0, 20, 60] and all(len(x) == 20 for x in w)
    with pytest.raises(ValueError, match="too short: 100 tokens.*4 samples x 30 tokens need 120"):
        sample_windows(ids, 4, 30)


def test_play_split_disjoint():
    assert not set(texts.CALIBRATION_EDITIONS) & set(texts.EVAL_EDITIONS)
    assert len(texts.CALIBRATION_PLAYS) >= 4 and len(texts.EVAL_PLAYS) >= 4


def _args(tmp_path, **kw):
    d = dict(model_path=None, output=str(tmp_path / "cfg.json"), text=None, num_samples=3,
             seq_len=64, device="cpu", quiet=True, operating_point=False)  # the point: test_frontier.py
    d.update(kw)
    return argparse.Namespace(**d)


def test_cli_writes_loadable_config(tmp_path):
    txt = tmp_path / "t.txt"
    txt.write_text("To be, or not to be, that is the question. " * 20)
    m = tiny_llama()
    c = m.config
    args = _args(tmp_path, text=[str(txt)])
    cli.run(args, model=m, tokenizer=ByteTokenizer(), argv_for_meta=["--text", "t.txt"])
    raw = json.loads((tmp_path / "cfg.json").read_text())
    meta = raw[ch.META_KEY]
    assert meta["num_samples"] == 3 and meta["tokens_per_layer"] == 192
    assert meta["command"].startswith("doublesparse calibrate --text")
    assert len(raw["model.layers.1.self_attn.qk_proj"]) == c.num_q_heads
    assert len(raw["model.layers.1.self_attn.qk_proj_kv"]) == c.num_kv_heads
    got = ch.load_channels(tmp_path / "cfg.json", c, "qk", 4, "group_sum")
    assert got.shape == (c.num_layers, c.num_kv_heads, 4)
    modes = ch.recorded_modes(raw, c.num_layers)               # each layer's mode, from measured recall
    assert modes == tuple(meta["selection"]["per_layer"]) and set(modes) <= {"group_sum", "group_max"}


def test_cli_too_short(tmp_path, capsys):
    txt = tmp_path / "t.txt"
    txt.write_text("short")
    with pytest.raises(ValueError, match="too short"):
        cli.run(_args(tmp_path, text=[str(txt)]), model=tiny_llama(), tokenizer=ByteTokenizer())


def test_main_reports_error(tmp_path, capsys, monkeypatch):
    txt = tmp_path / "t.txt"
    txt.write_text("short")
    monkeypatch.setattr(cli, "run", lambda args, argv_for_meta=None: (_ for _ in ()).throw(ValueError("too short")))
    assert cli.main(["--output", str(tmp_path / "x.json"), "--text", str(txt)]) == 2
    assert "too short" in capsys.readouterr().err
