"""The accuracy tooling with an fp8 K/V cache per setting (``Setting.kv``, ``--kv-cache-dtypes``):
names and bytes, a prefill and decode through the fp8 cache equal to a full forward over the
values the cache holds, labels from the unquantized K, and the three front ends (``doublesparse
eval``, the protocol, the long-context runner) with their summaries."""

import json
from dataclasses import replace

import pytest
import torch

from doublesparse.attention import k_rotation
from doublesparse.attention.base import as_cached
from doublesparse.calibrate.stats import make_batch
from doublesparse.channels.weights import default_channels
from doublesparse.eval import cli, driver, long_context, long_report, measure
from doublesparse.eval.settings import DENSE, Setting, default_setting, with_kv
from doublesparse.kernels.reference import quantize_kv
from doublesparse.models.simple_attention import plain_backend
from doublesparse.testing import tiny_llama

E4M3 = torch.float8_e4m3fn


def test_kv_setting_names_bytes_and_order():
    dims = (30, 9, 3, 64)
    f8 = replace(DENSE, kv="fp8_e4m3")
    assert f8.name == "dense/kv:fp8_e4m3" and f8.line == "dense+kv:fp8_e4m3"
    assert 2 * f8.bytes_per_step(4096, *dims) == DENSE.bytes_per_step(4096, *dims)
    s = Setting("ds", "qk", "group_max", 16, 1 / 16, label="fp8", kv="fp8_e5m2")
    assert s.name == "qk/group_max/r16/k1:16/fp8/kv:fp8_e5m2" and s.line.endswith("+fp8+kv:fp8_e5m2")
    assert s.bytes_per_step(4096, *dims) == 30 * (4096 * 3 * 16 * 1 + 256 * 3 * 64 * 2 * 1)
    assert replace(s, kv="bf16").bytes_per_step(4096, *dims) == 30 * (4096 * 3 * 16 + 256 * 3 * 64 * 2 * 2)
    with pytest.raises(ValueError, match="kv must be one of"):
        Setting(kv="fp8")
    d = default_setting(64)
    assert with_kv([DENSE, d], ["auto", "fp8_e4m3"]) == [DENSE, d, f8, replace(d, kv="fp8_e4m3")]
    assert with_kv([d], ["fp8_e4m3"]) == [DENSE, replace(d, kv="fp8_e4m3")]   # the reference comes in
    assert with_kv([d], ["auto"]) == [d]


class _AsCached:
    """A full causal forward over K/V as an fp8 cache holds them (scale 1), for every position;
    with ``rot`` ([L, Hkv, D, D]) over q and K rotated by it first."""

    def __init__(self, dtype, rot=None):
        self.inner, self.dtype, self.one, self.rot = plain_backend(), dtype, torch.ones(1), rot

    def forward(self, layer_id, q, k, v, batch):
        if self.rot is not None:
            q, k = k_rotation.rotate(q, k, self.rot[layer_id])
        return self.inner.forward(layer_id, q, as_cached(k, self.dtype, self.one, k.dtype),
                                  as_cached(v, self.dtype, self.one, v.dtype), batch)


def _setup(n=64, prefix=40, reqs=2, k_rotation="none", rot=None):
    m = tiny_llama()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (reqs, n), generator=g).tolist()
    with torch.no_grad():
        full = [m(torch.tensor(x), torch.arange(n), make_batch(_AsCached(E4M3, rot), None)) for x in ids]
    ps = driver.PoolSet(m, [x[:prefix] for x in ids], n, k_rotation=k_rotation)
    return m, ids, full, ps


def _relabel_and_decode(m, ids, auto, f8, ch, sparse):
    """The fp8 pools' decoded logits after the prompts: dense, or DS keeping every token (k 64) after
    relabelling with ``ch`` (the labels equal the model cache's) and then other channels (the stored
    K stays as it was)."""
    if not sparse:
        return driver.decode_tokens(m, f8, replace(DENSE, kv="fp8_e4m3"), None, [x[40:] for x in ids], 0)
    f8.relabel(ch)
    auto.relabel(ch)
    assert torch.equal(f8.label_pool(8)[0], auto.label_pool(8)[0])
    before = f8.k[1].clone()
    other = ch.roll(1, -1)
    f8.relabel(other)
    assert torch.equal(f8.k[1].view(torch.uint8), before.view(torch.uint8))   # K untouched by relabels
    s = Setting("ds", "qk", "group_max", 8, 1.0, kv="fp8_e4m3")
    return driver.decode_tokens(m, f8, s, other, [x[40:] for x in ids], 64)


@pytest.mark.parametrize("sparse", [False, True])
def test_fp8_prefill_and_decode_equal_a_forward_over_the_cached_values(sparse):
    """The fp8 pools' prefill attends to its K/V as stored and decode reads them back: the logits
    of the decoded tokens are the full forward's over the quantized K/V (dense, and DS keeping
    every token); layer 0's K is the model cache's quantized (its input does not depend on
    attention) and the labels come from the unquantized K, as the engine's store takes them
    (K not rotated: ``--kv-cache-k-rotation none``)."""
    m, ids, full, ps = _setup()
    auto, f8 = ps.get("auto"), ps.get("fp8_e4m3")
    assert ps.get("fp8_e4m3") is f8 and f8.k[0].dtype == E4M3 and f8.k_src[0].dtype == torch.float32
    assert torch.equal(f8.k[0].view(torch.uint8), quantize_kv(auto.k[0], E4M3, f8.k_scale).view(torch.uint8))
    assert not torch.equal(f8.k_src[1], auto.k[1])   # later layers: prefilled through the fp8 cache
    want = torch.cat([f[40:] for f in full])
    ch = default_channels(m, 8)
    torch.testing.assert_close(_relabel_and_decode(m, ids, auto, f8, ch, sparse), want, atol=1e-4, rtol=1e-4)
    plain = driver.decode_tokens(m, auto, DENSE, None, [x[40:] for x in ids], 0)
    assert (plain - want).abs().max() > 1e-3   # fp8 K/V changed the logits


@pytest.mark.parametrize("sparse", [False, True])
def test_rotated_fp8_pools_equal_a_forward_over_the_rotated_cached_values(sparse):
    """The default rotation: Hadamard blocks over all D for dense and DS settings alike (one
    rotated, prefilled cache serves both); the decoded logits are the full forward's over q and K
    rotated, then quantized; the labels come from the unrotated, unquantized K (layer 0: the
    model cache's labels exactly), and relabelling leaves the rotated K as it was."""
    m0 = tiny_llama()
    c = m0.config
    ch = default_channels(m0, 8)
    rot = k_rotation.rotation_matrices(c.num_layers, c.num_kv_heads, c.head_dim)
    m, ids, full, ps = _setup(k_rotation="auto", rot=rot)
    auto, f8 = ps.get("auto"), ps.get("fp8_e4m3")
    assert auto.k_rotation is None and torch.equal(f8.k_rotation, rot) and ps.get("fp8_e4m3") is f8
    krot = k_rotation.rotate(torch.zeros(1, c.num_q_heads, c.head_dim), auto.k[0], rot[0])[1]
    assert torch.equal(f8.k[0].view(torch.uint8), quantize_kv(krot, E4M3, f8.k_scale).view(torch.uint8))
    n = len(ps.prefixes[0])
    slots = f8.req_to_token[1, :n].long()
    assert torch.equal(f8.k_src[0][slots], auto.k[0][slots])   # the labels' source: the unrotated K
    want = torch.cat([f[40:] for f in full])
    torch.testing.assert_close(_relabel_and_decode(m, ids, auto, f8, ch, sparse), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["group_max", "per_head"])
def test_rotation_keeps_the_sparse_selection(mode):
    """``--kv-cache-k-rotation hadamard`` over the model's float32 cache: Double Sparsity decoding
    sparsely (k = 12 of up to 63 tokens, 3 requests) gives the unrotated logits, since the
    labels and label scores stay unrotated (the same selection) and R changes no attention
    score; the selection recall the observer measures is the unrotated one too."""
    m = tiny_llama()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (3, 64), generator=g).tolist()
    ch = default_channels(m, 8)
    s = Setting("ds", "qk", mode, 8, 1.0)
    res = {}
    for rot in ("none", "hadamard"):
        ps = driver.PoolSet(m, [x[:40] for x in ids], 64, k_rotation=rot)
        pools = ps.get("auto")
        assert (pools.k_rotation is None) == (rot == "none")
        pools.relabel(ch)
        obs = measure.FidelityObserver(m.config.num_layers)
        res[rot] = driver.decode_tokens(m, pools, s, ch, [x[40:] for x in ids], 12, observer=obs), obs.means()[0]
    torch.testing.assert_close(res["hadamard"][0], res["none"][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(res["hadamard"][1]), torch.tensor(res["none"][1]), atol=1e-4, rtol=0)


def test_text_runner_scores_fp8_settings_with_fidelity():
    """dense/kv:fp8 against dense (KL > 0), DS over the fp8 cache with per-layer fidelity; each fp8
    cache is prefilled when the first setting that reads it runs (rotated K: one for dense and DS
    alike, the labels staying unrotated)."""
    m = tiny_llama()
    g = torch.Generator().manual_seed(1)
    windows = [torch.randint(0, 256, (96,), generator=g).tolist() for _ in range(2)]
    ch = default_channels(m, 8)
    runner = measure.TextRunner(m, windows, 12, lambda s: ch)
    assert [k[0] for k in runner.groups[0][0]._by_kv] == ["auto"]
    ds = Setting("ds", "qk", "group_max", 8, 1 / 4, kv="fp8_e4m3")
    f8 = runner.run(replace(DENSE, kv="fp8_e4m3"))
    obs = measure.FidelityObserver(m.config.num_layers)
    r = runner.run(ds, obs)
    keys = list(runner.groups[0][0]._by_kv)
    assert keys == [("auto", False), ("fp8_e4m3", True)]
    assert runner.results[DENSE].kl == 0 and 0 < f8.kl < 0.1 and f8.top1 > 0.8
    assert r.kl > 0 and all(0 < x <= 1.0001 for x in r.recall) and all(x >= 0 for x in r.rel_err)


def _args(*argv):
    return cli.build_parser().parse_args(["-o", "x", *argv])


def test_cli_and_long_context_plans():
    d = default_setting(64)
    got = cli.settings_for(_args("--default-only", "--kv-cache-dtypes", "auto", "fp8_e4m3"))
    assert got == [DENSE, d, replace(DENSE, kv="fp8_e4m3"), replace(d, kv="fp8_e4m3")]
    got = cli.settings_for(_args("--default-only", "--kv-cache-dtypes", "fp8_e5m2"))
    assert got == [DENSE, replace(DENSE, kv="fp8_e5m2"), replace(d, kv="fp8_e5m2")]
    assert cli.settings_for(_args("--default-only")) == [DENSE, d]
    plan = long_context.plan(["dense", "default"], 64, 8192, kvs=["auto", "fp8_e4m3"])
    assert [s.name for s in plan][2:] == ["dense/kv:fp8_e4m3", plan[1].name + "/kv:fp8_e4m3"]


def test_protocol_runs_fp8_settings_in_parts_a_and_b(tmp_path):
    from doublesparse.eval import protocol
    out = tmp_path / "p"
    assert protocol.main(["-o", str(out), "--tiny", "--device", "cpu", "--window-len", "128", "--decode-len", "6",
                          "--num-windows", "1", "--retrieval-lens", "200", "--retrieval-depths", "0",
                          "--retrieval-trials", "1", "--parts", "ab", "--kv-cache-dtypes", "auto", "fp8_e4m3"]) == 0
    res = json.loads((out / "results.json").read_text())
    rows = {r["setting"]: r for r in res["rows"]}
    f8 = rows["dense/kv:fp8_e4m3"]
    assert not res["errors"] and f8["kv_cache_dtype"] == "fp8_e4m3" and f8["kl"] > 0 and "retrieval_acc" in f8
    assert res["default_setting"] + "/kv:fp8_e4m3" in rows and f8["bytes_vs_dense"] == 0.5
    assert "'/kv:...' settings" in (out / "table.md").read_text()


def test_long_context_summary_has_the_fp8_keys(tmp_path):
    out = tmp_path / "lc"
    assert long_context.main(["--tiny", "--device", "cpu", "-o", str(out), "--lengths", "300", "--num-windows", "1",
                              "--decode-len", "6", "--parts", "text", "--settings", "dense", "default", "--quiet",
                              "--kv-cache-dtypes", "auto", "fp8_e4m3"]) == 0
    res = json.loads((out / "results.json").read_text())
    s = res["summary"]
    assert not res["errors"] and res["kv_cache_dtypes"] == ["auto", "fp8_e4m3"] and len(res["settings"]) == 4
    text = res["text"]["300"]
    assert s["fp8_kv_ppl_increase_pct_300"] == pytest.approx(
        100 * (text["dense/kv:fp8_e4m3"]["ppl"] / text["dense"]["ppl"] - 1))
    d = res["default_setting"]
    assert s["fp8_kv_ds_ppl_points_300"] == pytest.approx(
        100 * (text[d + "/kv:fp8_e4m3"]["ppl"] - text[d]["ppl"]) / text["dense"]["ppl"])
    assert s["fp8_kv_ppl_increase_pct_300_ci95"] is None   # one window: no interval
    rows = {"smollm2-8k": res, "qwen15b-16k-fp8": {"summary": {"fp8_kv_ppl_increase_pct_16384": -1.0,
                                                                "fp8_kv_ppl_increase_pct_16384_ci95": [-3.0, 1.0],
                                                                "fp8_kv_ds_ppl_points_16384": 9.0}}}
    suite = long_report.suite_summary(rows)
    assert suite["fp8_kv_ppl_increase_pct_max"] == max(s["fp8_kv_ppl_increase_pct_300"], -1.0)
    assert suite["fp8_kv_ds_ppl_points_max"] == 9.0
