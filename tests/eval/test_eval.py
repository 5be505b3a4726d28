"""Eval: the decode driver equals sequential decoding on the real ops; eval --small end to end."""

import json
import math
from dataclasses import replace

import pytest
import torch

from doublesparse.calibrate.stats import make_batch
from doublesparse.models.simple_attention import plain_backend
from doublesparse.channels import default_channels
from doublesparse.eval import cli, driver, retrieval
from doublesparse.eval.settings import DENSE, Setting, preset
from doublesparse.testing import ByteTokenizer, tiny_llama


def _setup(n=64, prefix=40, reqs=2):
    m = tiny_llama()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (reqs, n), generator=g).tolist()
    with torch.no_grad():
        full = [m(torch.tensor(x), torch.arange(n), make_batch(plain_backend(), None)) for x in ids]
    p = driver.Pools(m.config, reqs, n)
    driver.prefill(m, p, [x[:prefix] for x in ids])
    return m, ids, full, p


def test_dense_decode_matches_full_forward():
    m, ids, full, p = _setup()
    got = driver.decode_tokens(m, p, DENSE, None, [x[40:] for x in ids], 0)
    torch.testing.assert_close(got, torch.cat([f[40:] for f in full]), atol=1e-4, rtol=1e-4)
    # Double Sparsity that keeps every token is exact too
    ch = default_channels(m, 8)
    p.relabel(ch)
    got = driver.decode_tokens(m, p, Setting("ds", "qk", "group_max", 8, 1.0), ch, [x[40:] for x in ids], 64)
    torch.testing.assert_close(got, torch.cat([f[40:] for f in full]), atol=1e-4, rtol=1e-4)


def test_batched_decode_equals_sequential():
    m, ids, full, p = _setup()
    s = Setting("ds", "qk", "group_sum", 4, 1 / 8)
    ch = default_channels(m, 4)
    p.relabel(ch)
    batched = driver.decode_tokens(m, p, s, ch, [x[40:] for x in ids], 6)
    assert (batched - torch.cat([f[40:] for f in full])).abs().max() > 1e-3  # it is sparse
    _, _, _, p2 = _setup()
    p2.relabel(ch)
    seq = [[], []]
    for j in range(24):
        out = driver.decode_tokens(m, p2, s, ch, [[x[40 + j]] for x in ids], 6)
        for i in range(2):
            seq[i].append(out[i])
            p2.prefix_len[i] += 1
    torch.testing.assert_close(batched, torch.cat([torch.stack(x) for x in seq]), atol=1e-5, rtol=1e-5)


def test_bytes_per_step():
    dims = (30, 9, 3, 64)
    dense = DENSE.bytes_per_step(4096, *dims)
    assert dense == 30 * 4096 * 3 * 64 * 2 * 2
    s = Setting("ds", "qk", "group_sum", 16, 1 / 16)
    assert s.bytes_per_step(4096, *dims) == 30 * (4096 * 3 * 16 * 2 + 256 * 3 * 64 * 2 * 2)
    ph = Setting("ds", "qk", "per_head", 16, 1 / 16)
    assert ph.bytes_per_step(4096, *dims) == 30 * (4096 * 3 * 16 * 2 + 256 * 9 * 64 * 2 * 2)
    d2 = Setting("ds", "qk", "group_sum", 16, 1 / 16, dense_layers=2)
    assert d2.bytes_per_step(4096, *dims) == 2 * dense // 30 + 28 * (4096 * 3 * 16 * 2 + 256 * 3 * 64 * 4)
    assert len(set(preset("full"))) == len(preset("full")) > 80


def test_fp8_label_setting():
    """fp8 labels: their own pool, half the label bytes, a name of their own; the decode equals
    the bf16 one where k keeps every token and stays close to it where it does not; the
    fidelity observer reads the fp8 pool."""
    dims = (30, 9, 3, 64)
    s = Setting("ds", "qk", "group_max", 16, 1 / 16, label="fp8")
    assert s.name == "qk/group_max/r16/k1:16/fp8" and s.line.endswith("+fp8")
    assert s.bytes_per_step(4096, *dims) == 30 * (4096 * 3 * 16 * 1 + 256 * 3 * 64 * 2 * 2)
    m, ids, full, p = _setup()
    ch = default_channels(m, 8)
    p.relabel(ch, "fp8")
    assert p.label_pool(8, "fp8")[0].dtype == torch.float8_e4m3fn and (8, "bf16") not in p.labels
    dense = torch.cat([f[40:] for f in full])
    whole = driver.decode_tokens(m, p, Setting("ds", "qk", "group_max", 8, 1.0, label="fp8"), ch,
                                 [x[40:] for x in ids], 64)
    torch.testing.assert_close(whole, dense, atol=1e-4, rtol=1e-4)
    p.relabel(ch)
    sparse = Setting("ds", "qk", "group_max", 8, 1 / 4)
    recall = {}

    def obs(layer_id, q, out, view):
        recall.setdefault(view.s.label, []).append(driver.selection_recall(q, view, layer_id).mean())

    bf = driver.decode_tokens(m, p, sparse, ch, [x[40:] for x in ids], 16, observer=obs)
    f8 = driver.decode_tokens(m, p, replace(sparse, label="fp8"), ch, [x[40:] for x in ids], 16, observer=obs)
    assert (bf - dense).abs().max() > 1e-3  # it is sparse
    assert (f8 - bf).abs().max() < 0.5 * (bf - dense).abs().max() + 1e-2
    assert len(recall["fp8"]) == len(recall["bf16"]) == 2 and all(0 < r <= 1.0001 for r in recall["fp8"])
    with pytest.raises(ValueError):
        Setting(label="fp16")


def test_retrieval_prompt():
    tok = ByteTokenizer()
    ids = retrieval.build_prompt(tok, 600, 0.5, "12345")
    text = tok.decode(ids)
    assert 600 - 100 < len(ids) <= 600 and text.count("12345") == 2 and text.endswith(retrieval.ANSWER_PREFIX)
    assert retrieval.answer_ok(" 12345.", "12345") and not retrieval.answer_ok(" 1234", "12345")


def test_eval_small_end_to_end(tmp_path):
    out = tmp_path / "ev"
    rc = cli.main(["--tiny", "--small", "-o", str(out), "--window-len", "128", "--decode-len", "10",
                   "--retrieval-lens", "200", "--retrieval-depths", "0", "1", "--quiet"])
    assert rc == 0
    table = (out / "table.md").read_text()
    assert "| dense |" in table and "qk/group_sum/r16/k1:16" in table
    res = json.loads((out / "results.json").read_text())
    rows = {r["setting"]: r for r in res["rows"]}
    assert rows["dense"]["kl"] == 0 and rows["dense"]["top1"] == 1
    assert all("ppl" in r and "retrieval_acc" in r for r in rows.values())
    ds = rows["qk/group_sum/r16/k1:16"]
    assert len(ds["recall_per_layer"]) == 2 and 0 < ds["recall"] <= 1.0001
    assert len(ds["attn_mass_per_layer"]) == 2 and 0 < ds["attn_mass"] <= ds["recall"]
    assert ds["bytes_per_step"] < rows["dense"]["bytes_per_step"]
    wide = rows["qk/group_max/r16/k1:8/s4w32"]
    for name in ("qk/group_max/r16/k1:8/s4w32/p0.9min32", "qk/group_max/r16/k1:8/s4w32/p0.98min32"):
        tp = rows[name]  # the top-p budget: tokens per row measured, at most the upper bound's
        assert 0 < tp["avg_k"] <= wide["avg_k"] == 16 and tp["bytes_per_step"] <= wide["bytes_per_step"]
    assert (out / "plot.png").stat().st_size > 1000


def test_selection_recall_matches_reference():
    from doublesparse.kernels import reference as ref
    m, ids, full, p = _setup()
    s = Setting("ds", "qk", "group_max", 4, 1 / 8, num_sink=2, num_recent=3)
    ch = default_channels(m, 4)
    p.relabel(ch)
    seen = {}

    def obs(layer_id, q, out, view):
        got, mass = driver.selection_recall(q, view, layer_id, chunk=5, with_mass=True)
        torch.testing.assert_close(got, driver.selection_recall(q, view, layer_id, chunk=5))
        sc = ref.label_scores_ref(q, p.label_pool(4)[layer_id], p.label_scale, view.channels[layer_id],
                                  p.req_to_token, view.req_idx, view.seq_lens, s.mode, view.sm_scale)
        assert (view.num_sink, view.num_recent) == (1, 2)  # capped at k/8, k/4 (k = 8) like the engine
        sc = ref.force_keep(sc, view.seq_lens, view.num_sink, view.num_recent)
        for b in range(q.shape[0]):
            n = int(view.seq_lens[b])
            k = ref.gather_tokens(p.k[layer_id], p.req_to_token, view.req_idx, b, n).repeat_interleave(2, 1)
            prob = (torch.einsum("hd,nhd->hn", q[b].float(), k) * view.sm_scale).softmax(-1)
            sel = sc[b, :, :n].topk(view.k_max, -1).indices.repeat_interleave(2, 0)
            share = prob.gather(1, sel).sum(-1)
            want = share / prob.topk(view.k_max, -1).values.sum(-1)
            torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mass[b], share, atol=1e-5, rtol=1e-5)
        seen[layer_id] = True

    driver.decode_tokens(m, p, s, ch, [x[40:] for x in ids], 8, observer=obs)
    assert seen == {0: True, 1: True}


def test_triton_path_matches_reference():
    """The driver on the Triton kernels (interpreted on CPU) gives the reference's logits.

    Only modes without near-ties are compared exactly: the Triton store truncates fp32 -> bf16
    labels where torch rounds to nearest (seen under TRITON_INTERPRET), which can flip near-tied
    selections (per_head, sink/recent) on this random model."""
    import os
    import pytest
    if torch.cuda.is_available():
        pytest.skip("interpreter twin on CPU tensors; on a GPU the kernel tests cover the kernels")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    m = tiny_llama()
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(3)).tolist()
    ch = default_channels(m, 4)
    for s in (DENSE, Setting("ds", "qk", "group_max", 4, 1 / 6), Setting("ds", "qk", "group_sum", 4, 1 / 6)):
        got = {}
        for impl in ("torch", "triton"):
            p = driver.Pools(m.config, 1, 48, impl=impl)
            driver.prefill(m, p, [ids[0][:40]])
            p.relabel(ch)
            got[impl] = driver.decode_tokens(m, p, s, ch, [ids[0][40:44]], 8)
        torch.testing.assert_close(got["triton"], got["torch"], atol=1e-4, rtol=1e-4)


def _args(**kw):
    return cli.build_parser().parse_args(["-o", "x"] + [a for k, v in kw.items()
                                                        for a in ([f"--{k}"] + [str(x) for x in v])])


def test_settings_for_has_each_setting_once():
    """``--modes group_max`` used to run qk/group_max/r16/k1:16 twice (grid and variants)."""
    from doublesparse.eval.settings import default_setting
    ss = cli.settings_for(_args(modes=["group_max", "group_sum"], rs=[16], **{"k-fracs": [0.0625]}))
    assert len(ss) == len(set(ss))
    assert ss[:2] == [DENSE, default_setting(64)]
    d = default_setting(64)
    assert (d.mode, d.r, d.k_frac, d.num_sink, d.num_recent) == ("group_max", 16, 1 / 16, 4, 32)
    assert d.sink_recent(512) == (4, 32) and d.sink_recent(64) == (4, 16)  # the engine's scaling


def test_relabel_is_skipped_for_the_same_channels(monkeypatch):
    m, ids, full, p = _setup()
    calls = []
    real = driver.ops.store_kv
    monkeypatch.setattr(driver.ops, "store_kv", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    ch = default_channels(m, 4)
    p.relabel(ch)
    n = len(calls)
    assert n == m.config.num_layers
    s = Setting("ds", "qk", "group_sum", 4, 1 / 8)
    a = driver.decode_tokens(m, p, s, ch, [x[40:] for x in ids], 6)
    p.relabel(ch.clone())                      # same channels: the prefix labels are still right
    assert len(calls) == n + m.config.num_layers  # only the decode's own stores
    torch.testing.assert_close(driver.decode_tokens(m, p, s, ch, [x[40:] for x in ids], 6), a)
    p.relabel(ch.flip(-1))                     # other channels (same r): relabelled
    assert len(calls) == n + 3 * m.config.num_layers


def test_text_runner_matches_evaluate_text_and_fidelity_stride():
    from doublesparse.eval import measure
    m = tiny_llama()
    g = torch.Generator().manual_seed(1)
    windows = torch.randint(0, 256, (2, 96), generator=g).tolist()
    ch = default_channels(m, 4)
    s = Setting("ds", "qk", "group_max", 4, 1 / 8, num_sink=2, num_recent=4)
    runner = measure.TextRunner(m, windows, 24, lambda _: ch)
    got = runner.run(s)                        # dense runs first by itself (KL needs it)
    assert DENSE in runner.results and got.kl > 0 and 0 < got.top1 < 1 and got.tokens == 46
    want = measure.evaluate_text(m, windows, 24, [DENSE, s], lambda _: ch, fidelity=True, progress=False)[1]
    assert abs(got.ppl - want.ppl) < 1e-4 and abs(got.kl - want.kl) < 1e-6
    half = runner.run(s, measure.FidelityObserver(2, stride=2, chunk=5))
    assert len(half.recall) == 2 and all(0 < x <= 1 + 1e-6 for x in half.recall)
    assert all(abs(a - b) < 0.15 for a, b in zip(half.recall, want.recall))  # half the tokens
    assert runner.run(s).recall == half.recall  # a later plain run keeps the fidelity
    # the perplexity's 95 % interval against dense, from the two windows' paired mean NLLs
    lo, hi = got.extra["ppl_pct_ci95"]
    d = [a - b for a, b in zip(runner.window_nll[s], runner.window_nll[DENSE])]
    assert len(d) == 2 and lo < 100 * (math.exp(sum(d) / 2) - 1) < hi
    assert abs(100 * (got.ppl / runner.results[DENSE].ppl - 1) - 100 * (math.exp(sum(d) / 2) - 1)) < 1e-3
    assert measure.ppl_interval([1.1, 1.2, 1.3], [1.0, 1.1, 1.2]) == pytest.approx(
        [100 * (math.exp(0.1) - 1)] * 2, abs=1e-6)   # equal differences: no width
    lo, hi = measure.ppl_interval([1.0, 1.2, 1.1], [1.0, 1.1, 1.0])   # d = 0, 0.1, 0.1: t(2) = 4.30
    half = 4.30 * math.sqrt(((0 - 0.2 / 3) ** 2 + 2 * (0.1 - 0.2 / 3) ** 2) / 2) / math.sqrt(3)
    assert (lo, hi) == pytest.approx((100 * (math.exp(0.2 / 3 - half) - 1), 100 * (math.exp(0.2 / 3 + half) - 1)))


def test_selection_recall_rows_subset():
    m, ids, full, p = _setup()
    s = Setting("ds", "qk", "group_sum", 4, 1 / 8)
    ch = default_channels(m, 4)
    p.relabel(ch)
    seen = []

    def obs(layer_id, q, out, view):
        every = driver.selection_recall(q, view, layer_id, chunk=7)
        rows = torch.tensor([0, 5, 30, 47])
        torch.testing.assert_close(driver.selection_recall(q, view, layer_id, chunk=3, rows=rows), every[rows])
        seen.append(layer_id)

    driver.decode_tokens(m, p, s, ch, [x[40:] for x in ids], 8, observer=obs)
    assert seen == [0, 1]


def test_selection_recall_top_p():
    """A top-p setting's recall counts only the kept part of the same selection: never above the
    fixed budget's, and its decode reports fewer tokens per row than the upper bound."""
    m, ids, _, p = _setup()
    ch = default_channels(m, 4)
    p.relabel(ch)
    rec, stats = {}, []
    for s in (Setting("ds", "qk", "group_sum", 4, 1 / 8), Setting("ds", "qk", "group_sum", 4, 1 / 8, top_p=0.05,
                                                                   top_p_min=2)):
        def obs(layer_id, q, out, view, s=s):
            rec.setdefault(s.top_p, []).append(driver.selection_recall(q, view, layer_id))

        driver.decode_tokens(m, p, s, ch, [x[40:] for x in ids], 8, observer=obs, k_stats=stats)
    assert all(bool((a <= b + 1e-6).all()) and float(a.min()) > 0 for a, b in zip(rec[0.05], rec[0.0]))
    (fixed_sum, fixed_rows), (tp_sum, tp_rows) = stats
    assert float(fixed_sum / fixed_rows) == 8 and 2 <= float(tp_sum / tp_rows) < 8


def test_make_trials_reuses_the_filler_count():
    tok = ByteTokenizer()
    trials = retrieval.make_trials(tok, [400, 700], [0.0, 0.5, 1.0], 3, seed=2)
    assert len(trials) == 18 and len({t.key for t in trials}) == 18
    for t in trials:  # the same prompt as building it from scratch
        assert list(t.ids) == retrieval.build_prompt(tok, t.context_len, t.depth, t.key)
        assert len(t.ids) <= t.context_len


def test_protocol_end_to_end_and_budget(tmp_path, monkeypatch):
    from doublesparse.eval import protocol
    small = ["--tiny", "--device", "cpu", "--window-len", "128", "--decode-len", "6", "--num-windows", "2",
             "--retrieval-lens", "200", "--retrieval-depths", "0", "1", "--retrieval-trials", "1",
             "--types", "qk", "--modes", "group_max", "group_sum", "--rs", "4", "--k-fracs", "0.125"]
    out = tmp_path / "full"
    assert protocol.main(["-o", str(out)] + small) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["parts"]) == {"a", "b", "c-text", "c-ret", "d"} and not res["errors"]
    rows = {r["setting"]: r for r in res["rows"]}
    assert len(rows) == len(res["rows"])  # each setting once
    d = rows[res["default_setting"]]
    assert "retrieval_acc" in d and d["top1"] <= 1 and len(d["recall_per_layer"]) == 2
    assert rows["dense"]["kl"] == 0 and (out / "plot.png").is_file() and (out / "table.md").is_file()
    # no time left after loading: every part is skipped, yet the outputs are written
    out2 = tmp_path / "none"
    assert protocol.main(["-o", str(out2), "--budget-s", "1", "--reserve-s", "0"] + small) == 0
    res2 = json.loads((out2 / "results.json").read_text())
    assert res2["parts"]["a"] == "0/3 settings" and res2["rows"] == []


def test_stage_texts_and_env_override(tmp_path, monkeypatch):
    from doublesparse import assets
    from doublesparse.texts import EVAL_EDITIONS
    from doublesparse.eval import protocol
    src = tmp_path / "src"
    src.mkdir()
    for e in EVAL_EDITIONS:
        (src / f"{e}.txt").write_text(f"text of {e}\n")
    monkeypatch.delenv("DOUBLESPARSE_SHAKESPEARE", raising=False)
    monkeypatch.setenv("DOUBLESPARSE_SHAKESPEARE_DIR", str(src))
    assert assets.shakespeare_dir() == src
    files = protocol.stage_texts(tmp_path / "stage")
    assert sorted(f.name for f in files) == sorted(f"{e}.txt" for e in EVAL_EDITIONS)
    monkeypatch.setenv("DOUBLESPARSE_SHAKESPEARE_DIR", str(tmp_path / "stage"))
    assert assets.read_play("hamlet_gut") == "text of hamlet_gut\n"
    assert protocol.texts_available(protocol.build_parser().parse_args([])) is None
