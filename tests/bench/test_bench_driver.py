"""benchmarks/run.py: every suite's --dry-run works on a CPU and its commands parse with the real
argument parsers of the modules they run."""

import argparse
import json
import importlib
import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_run", ROOT / "benchmarks" / "run.py")
bench_run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_run)


class _Parsed(Exception):
    pass


def _parse_with_main(module: str, args: list[str]) -> argparse.Namespace:
    """Parse ``args`` with the parser a module's main() builds, stopping right after parsing."""
    real = argparse.ArgumentParser.parse_args
    got = {}

    def parse_args(self, a=None, namespace=None):
        got["ns"] = real(self, a, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_args
    try:
        with pytest.raises(_Parsed):
            importlib.import_module(module).main(args)
    finally:
        argparse.ArgumentParser.parse_args = real
    return got["ns"]


def parse(argv: list[str]) -> argparse.Namespace:
    if argv[0] == "doublesparse":
        assert argv[1] == "eval", argv
        return importlib.import_module("doublesparse.eval.cli").build_parser().parse_args(argv[2:])
    if argv[0] == "python" and argv[1].startswith("benchmarks/") and argv[1].endswith(".py"):
        return _parse_with_main(argv[1][len("benchmarks/"):-3], argv[2:])  # run.py puts benchmarks/ on the path
    assert argv[:2] == ["python", "-m"], argv
    module, args = argv[2], argv[3:]
    # SGLang's command names are thin doors to the bench modules
    module = {"doublesparse.bench_one_batch": "doublesparse.bench.one_batch",
              "doublesparse.bench_serving": "doublesparse.bench.serving"}.get(module, module)
    if module in ("doublesparse.bench.one_batch", "doublesparse.bench.family_decode", "doublesparse.bench.hf_offload",
                  "doublesparse.bench.offload", "doublesparse.bench.lmeval", "doublesparse.bench.adaptive",
                  "doublesparse.bench.moe_experts", "doublesparse.bench.recall_agreement", "doublesparse.bench.heap"):
        return importlib.import_module(module).build_parser().parse_args(args)
    if module in ("doublesparse.bench.serving", "doublesparse.bench.soak"):
        return importlib.import_module(module).parse_args(args)
    if module in ("doublesparse.eval.protocol", "doublesparse.eval.long_context"):
        return importlib.import_module(module).build_parser().parse_args(args)
    if module == "doublesparse.launch_server":
        return importlib.import_module("doublesparse.server.cli").build_parser().parse_args(args)
    if module in ("doublesparse.bench.attention", "doublesparse.bench.sampling"):
        return _parse_with_main(module, args)
    raise AssertionError(f"no parser known for {module}")


@pytest.mark.parametrize("suite", sorted(bench_run.SUITES))
def test_dry_run_prints_the_commands(suite, tmp_path, capsys):
    raw = tmp_path.resolve() / "raw"
    assert bench_run.main([suite, "--dry-run", "--out", str(tmp_path), "--raw", str(raw)]) == 0
    stdout = capsys.readouterr().out
    rows = bench_run.suite_commands(suite, raw)
    for r in rows:
        assert (f"{r['name']}: skipped" if r.get("skip") else r["cmd"]) in stdout
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"


def test_dry_run_as_a_script(tmp_path):
    """``python benchmarks/run.py`` itself (the suites above run through main() in-process)."""
    raw = tmp_path.resolve() / "raw"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "attention", "--dry-run",
                          "--out", str(tmp_path), "--raw", str(raw)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert all(r["cmd"] in out.stdout for r in bench_run.suite_commands("attention", raw))
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"


@pytest.mark.parametrize("suite", sorted(bench_run.SUITES))
def test_commands_parse(suite):
    for r in bench_run.suite_commands(suite):
        ns = parse(r["argv"])
        assert "{" not in r["cmd"], r["cmd"]
        if r["server_argv"]:
            parse(r["server_argv"])
        assert ns is not None


def test_result_file_names():
    assert bench_run.machine_slug("NVIDIA H200") == "h200"
    assert bench_run.machine_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert bench_run.machine_slug("CPU (x86_64, 2 cores)") == "cpu"
    assert {s["area"] for s in bench_run.SUITES.values()} >= {"attention", "bench-one-batch", "serving", "accuracy"}
    one_batch = bench_run.suite_commands("one-batch")
    assert shlex.join(one_batch[0]["argv"]).startswith("python -m doublesparse.bench_one_batch")


def test_speedup_map_summary_table_and_heatmap(tmp_path):
    """The speedup-map suite's summary, table and heatmap from bench_one_batch-shaped results."""
    def run(scale, sparse):
        res = [{"batch_size": b, "input_len": n, "median_decode_latency": scale * (1 + b * n / 1e6),
                "median_step_bytes": scale * 1e9 * (1 + b * n / 1e6), "sparse_steps": sparse,
                "decode_steps": 23} for b in (1, 8, 32) for n in (16384, 32768, 120000) if b * n < 2e6]
        return {"results": res + [{"batch_size": 64, "input_len": 120000, "skipped": "does not fit"}]}
    rows = {"map-dense": run(1.0, 0), "map-ds": run(0.5, 23),
            **{f"prefill-60k-bs3-{m}": {"copy_bandwidth": 4e12, "results": [{
                "median_decode_latency": t, "prefill_throughput": 1.7e4, "median_decode_throughput": 3 / t,
                "median_step_bytes": 4e12 * t / 1.1, "sparse_steps": n, "decode_steps": 199}]}
               for m, t, n in (("dense", 9.7, 0), ("ds", 5.0, 199))}}
    s = bench_run.summarize("speedup-map", rows)
    assert s["min_ratio"] == pytest.approx(2.0) and s["bs32_16k"] == pytest.approx(2.0)
    assert s["bs1_120k"] == pytest.approx(2.0) and s["bs3_60k"] == pytest.approx(1.94)
    assert len(s["cells"]) == 8
    doc = {"suite": "speedup-map", "area": "speedup-map", "machine": "GPU X", "date": "d", "commit": "c",
           "summary": s, "rows": rows, "commands": ["x"], "png": "m.png"}
    md = bench_run.markdown(doc)
    assert "| 32 | 2.00 (2.00) |" in md and "![speedup map](m.png)" in md
    png = bench_run.speedup_map.heatmap(s["cells"], tmp_path / "m.png", "t")
    assert png.stat().st_size > 1000


def test_prefix_cache_summary_from_bench_serving_metrics():
    """The prefix-cache suite's summary and table read the keys bench_serving writes."""
    from doublesparse.bench import serving as B

    def metrics(ttft_cold, ttft_warm, duration, hit, lost=0):
        rs = [B.Result(ok=True, ttft=ttft_cold if i < 4 else ttft_warm, latency=2.0, output_tokens=8, group=i % 4)
              for i in range(16)]
        for r in rs[:lost]:
            r.ok, r.error = False, "boom"
        m = B.summarize(rs, duration, 8)
        m.update(prefix_cache_hit_rate=hit, server_counters={"prefix_cache_evicted_tokens": 5000.0})
        return {"metrics": m}

    rows = {"disabled": metrics(3.0, 3.0, 100.0, None), "radix-cache": metrics(3.0, 0.15, 20.0, 0.9),
            "eviction": metrics(3.0, 3.0, 50.0, 0.1, lost=1)}
    s = bench_run.summarize("prefix-cache", rows)
    assert s["speedup_vs_disabled"] == pytest.approx(5.0) and s["hit_rate"] == 0.9
    assert s["ttft_warm_over_cold_p50"] == pytest.approx(0.05)
    assert s["eviction_run_failed"] == 1 and s["eviction_run_evicted_tokens"] == 5000.0
    doc = {"suite": "prefix-cache", "area": "prefix-cache", "machine": "GPU X", "date": "d", "commit": "c",
           "summary": s, "rows": rows, "commands": ["x"]}
    md = bench_run.markdown(doc)
    assert "| radix-cache | 20.0 | 3000 | 150 | 0.050 | 0.900 |" in md


def test_prefix_cache_suite_in_two_parts_merges(tmp_path, monkeypatch):
    """The driver end to end on the CPU, in two parts (--only, then --merge): rows that write
    bench_serving-shaped results, the summary with the run's commands, date, device and commit."""
    def row(name, duration, hit):
        m = {"duration_s": duration, "valid_requests": 8, "completed": 8, "errors": 0,
             "ttft_warm_over_cold_p50": 0.05, "prefix_cache_hit_rate": hit, "server_counters": {}}
        code = f"import json, sys; json.dump({{'metrics': {m!r}}}, open(sys.argv[1], 'w'))"
        return {"name": name, "cmd": f"python -c {shlex.quote(code)} {{out}}.json", "result": "{out}.json"}

    suite = {"area": "prefix-cache", "rows": [row("disabled", 90.0, None), row("radix-cache", 15.0, 0.93),
                                              row("eviction", 40.0, 0.1)]}
    monkeypatch.setitem(bench_run.SUITES, "prefix-cache", suite)
    base = ["prefix-cache", "--out", str(tmp_path), "--machine", "t", "--commit", "abc"]
    assert bench_run.main([*base, "--only", "disabled"]) == 0
    assert bench_run.main([*base, "--only", "radix-cache", "eviction", "--merge"]) == 0
    doc = json.loads((tmp_path / "prefix-cache-t.json").read_text())
    s = doc["summary"]
    assert list(doc["rows"]) == ["disabled", "radix-cache", "eviction"]
    assert s["speedup_vs_disabled"] == pytest.approx(6.0) and s["hit_rate"] == 0.93
    assert s["eviction_run_failed"] == 0 and s["commit"] == "abc" and s["device"] and s["date"]
    assert len(s["commands"]) == 3 and "| radix-cache | 15.0 |" in (tmp_path / "prefix-cache-t.md").read_text()
    assert "row_commits" not in doc  # one commit gave every row
    # a row redone at a later commit: the file names the commit of each row
    assert bench_run.main([*base[:-1], "def", "--only", "eviction", "--merge"]) == 0
    doc = json.loads((tmp_path / "prefix-cache-t.json").read_text())
    assert doc["commit"] == "def" and doc["row_commits"] == {"disabled": "abc", "radix-cache": "abc", "eviction": "def"}
    assert "Commit: `def` (rows disabled, radix-cache at `abc`)" in (tmp_path / "prefix-cache-t.md").read_text()


def test_result_file_written_after_each_row(tmp_path, monkeypatch):
    """The result file is rewritten as each row ends, so a run killed from outside (a device
    command's time limit) keeps the rows it finished; the rows not ended yet say so, and with
    --merge they keep the earlier file's rows until they end."""
    def row(name, code):
        return {"name": name, "cmd": f"python -c {shlex.quote(code)} {{out}}.json", "result": "{out}.json"}

    seen = tmp_path / "prefix-cache-t.json"
    look = (f"import json, sys; d = json.load(open({str(seen)!r})); "
            "json.dump({'metrics': {}, 'saw': {k: sorted(v) for k, v in d['rows'].items()}}, open(sys.argv[1], 'w'))")
    suite = {"area": "prefix-cache", "rows": [row("first", "import json, sys; json.dump({'metrics': {'x': 1}}, open(sys.argv[1], 'w'))"),
                                              row("second", look), row("third", look)]}
    monkeypatch.setitem(bench_run.SUITES, "prefix-cache", suite)
    base = ["prefix-cache", "--out", str(tmp_path), "--machine", "t", "--commit", "abc"]
    assert bench_run.main(base) == 0
    rows = json.loads(seen.read_text())["rows"]
    assert rows["second"]["saw"] == {"first": ["metrics", "wall_s"], "second": ["skipped"], "third": ["skipped"]}
    assert rows["third"]["saw"]["second"] == ["metrics", "saw", "wall_s"]
    # --merge: a row not ended yet is the earlier file's until it ends
    assert bench_run.main([*base, "--only", "third", "--merge"]) == 0
    rows = json.loads(seen.read_text())["rows"]
    assert rows["third"]["saw"]["third"] == ["metrics", "saw", "wall_s"]


def test_decode_cost_figures_recover_a_known_machine():
    """The decode-cost suite's fit returns the bandwidth and per-layer overhead the steps were made with."""
    import decode_cost  # run.py put benchmarks/ on the path

    bw, t0, over, L = 12e9, 0.004, 250e-6, 30

    def doc(sparse):
        rs = []
        for n in (1024, 2048, 4096, 8000):
            b = 123_000_000 + n * (2_000 if sparse else 46_000)
            rs.append({"input_len": n, "median_step_bytes": b, "decode_steps": 15, "sparse_steps": 15 if sparse else 0,
                       "median_decode_latency": t0 + b / bw + (L * over if sparse else 0.0)})
        return {"device": "cpu", "num_layers": L, "results": rs}

    s = decode_cost.figures(doc(False), doc(True))
    assert abs(s["bandwidth_gbs"] - 12) < 1e-6 and abs(s["ds_step_overhead_us_per_layer"] - 250) < 1e-6
    assert s["kernel_tuning"] == {"cpu_decode_bandwidth_gbs": 12.0, "cpu_ds_step_overhead_us_per_layer": 250.0}
    assert s["sparse_all_sparse"] and s["dense_sparse_steps"] == 0
    assert len(decode_cost.table(doc(False), doc(True))) == 6


def test_rows_sized_to_the_card():
    """``{pool:TOKENS:GB}`` pins the pool on a card of GB or more and leaves it to the engine on a
    smaller one; a row needing more memory than the card has is skipped with why."""
    suite = bench_run.SUITES["prefix-cache"]
    big = bench_run.expand(suite, Path("raw"), gb=141)
    small = bench_run.expand(suite, Path("raw"), gb=80)
    assert "--max-total-tokens 540672" in big[1]["server"] and "--max-total-tokens" not in small[1]["server"]
    rows = {r["name"]: r for r in bench_run.expand(bench_run.SUITES["models"], Path("raw"), gb=80)}
    assert "needs a card of >= 120 GB" in rows["mixtral-32k-bs8-ds"]["skip"]
    assert "skip" not in rows["dsv2-lite-128k-bs4-ds"]
    # an 80 GB card runs Qwen3-MoE at 4 x 32K, a bigger one at 8 x 32K (and not the small variant)
    assert "skip" not in rows["qwen3-moe-32k-bs4-ds"] and "skip" in rows["qwen3-moe-32k-bs8-ds"]
    big = {r["name"]: r for r in bench_run.expand(bench_run.SUITES["models"], Path("raw"), gb=141)}
    assert "sized for cards below 120 GB" in big["qwen3-moe-32k-bs4-dense"]["skip"]
    assert all("skip" not in r for n, r in big.items() if "-bs4-" not in n or n.startswith("dsv2"))


def test_models_summary_reads_the_card_sized_row():
    """On an 80 GB card the Qwen3-MoE figures come from the 4 x 32K row."""
    def res(lat, floor):
        return {"results": [{"median_decode_latency": lat, "floor": {"floor_s": floor, "over_floor": lat / floor}}]}
    rows = {"qwen3-moe-32k-bs8-dense": {"skipped": "needs a card"}, "qwen3-moe-32k-bs4-dense": res(0.016, 0.01),
            "qwen3-moe-32k-bs4-ds": res(0.012, 0.007)}
    s = bench_run.summarize("models", rows)
    assert s["qwen3_moe_dense_over_floor"] == pytest.approx(1.6) and s["qwen3_moe_ds_over_floor"] == pytest.approx(12 / 7)


def test_gpu_check_lanes_budget_and_summary(tmp_path, monkeypatch):
    """The gpu-check driver on the CPU with stand-in rows: a lane runs beside the main one, a row
    that cannot start within the budget is recorded as not run, the summary counts the tests."""
    def row(name, doc, sleep=0.0, **kw):
        code = f"import json, sys, time; time.sleep({sleep}); json.dump({doc!r}, open(sys.argv[1], 'w'))"
        return {"name": name, "cmd": f"python -c {shlex.quote(code)} {{out}}.json", "result": "{out}.json", **kw}

    tests = {"passed": 10, "failed": 0, "skipped": 2, "failures": [], "failed_only_sharing_the_card": [],
             "workers": 4, "ended": "exit 0", "wall_s": 1.0}
    suite = {"area": "gpu-check", "budget_s": 20, "rows": [
        row("tests", tests, 1.0, min_s=0.1), row("soak", {"lost_valid": 0, "http_5xx": 0}, 1.0, lane="server", min_s=0.1),
        row("late", {}, 0.0, min_s=60), row("too-big", {}, min_gb=10 ** 6)]}
    monkeypatch.setitem(bench_run.SUITES, "gpu-check", suite)
    t0 = __import__("time").time()
    assert bench_run.main(["gpu-check", "--out", str(tmp_path), "--machine", "t", "--commit", "abc"]) == 0
    assert __import__("time").time() - t0 < 30
    doc = json.loads((tmp_path / "gpu-check-t.json").read_text())
    s = doc["summary"]
    assert (s["passed"], s["failed"], s["skipped"]) == (10, 0, 2) and s["card"] and s["wall_min"] >= 0
    assert s["rows"]["soak"] == "ok" and s["soak"]["lost_valid"] == 0
    assert s["rows"]["late"].startswith("skipped: not run") and "needs a card" in s["rows"]["too-big"]
    assert "| soak | ok |" in (tmp_path / "gpu-check-t.md").read_text()


def test_gpu_check_reads_pytest_output():
    gpu_check = importlib.import_module("gpu_check")
    text = ("[gw0] [ 10%] PASSED tests/a.py::test_x \n[gw1] [ 20%] FAILED tests/a.py::test_y[1-2] \n"
            "[gw1] [ 30%] SKIPPED tests/b.py::test_z@tests/b.py::srv/ \ntests/a.py::test_w PASSED\n"
            "[gw2] [ 35%] PASSED tests/c.py::test_v[a b - c] \n"
            "[gw0] [ 40%] ERROR tests/a.py::test_x \n")
    assert gpu_check.parse_pytest(text) == {"tests/a.py::test_x": "ERROR", "tests/a.py::test_y[1-2]": "FAILED",
                                            "tests/b.py::test_z": "SKIPPED", "tests/a.py::test_w": "PASSED",
                                            "tests/c.py::test_v[a b - c]": "PASSED"}
    summary = ("FAILED tests/a.py::test_y[1-2] - AssertionError: assert 3 == 2\n"
               "FAILED tests/c.py::test_v[a b - c] - RuntimeError: CUDA out of memory\n"
               "ERROR tests/a.py::test_x\n")
    assert gpu_check.failure_reasons(summary) == {"tests/a.py::test_y[1-2]": "AssertionError: assert 3 == 2",
                                                  "tests/c.py::test_v[a b - c]": "RuntimeError: CUDA out of memory",
                                                  "tests/a.py::test_x": ""}


def test_recall_overhead_summary():
    def row(step_s):
        return {"results": [{"decode_latencies": [step_s] * 4}]}
    rows = {"llama31-8b-60k-bs3-ds-recall0": row(1.0), "llama31-8b-60k-bs3-ds-recall64": row(1.01),
            "llama31-8b-60k-bs3-ds-recall1": row(1.5), "llama31-8b-16k-bs32-ds-recall0": row(2.0),
            "llama31-8b-16k-bs32-ds-recall64": row(2.04)}
    s = bench_run.summarize("recall", rows)
    assert s["recall_overhead_pct"] == pytest.approx(2.0) and s["recall_agreement_abs"] is None
    rows["smollm2-8k-agreement"] = {"summary": {"recall_agreement_abs": 0.004, "matched_abs": 1e-7}}
    s = bench_run.summarize("recall", rows)
    assert s["recall_agreement_abs"] == 0.004 and s["agreement"]["matched_abs"] == 1e-7
    assert s["by_shape"]["60k-bs3"] == pytest.approx({"default": 1.0, "every_step": 50.0})


def test_fp8_kv_summary():
    """The fp8-kv suite's summary keys from its rows' result files (synthetic figures)."""
    def one(lat, **kw):
        return {"results": [{"median_decode_latency": lat, "median_step_bytes": 1e9, "batch_size": 3}],
                "copy_bandwidth": 1e12, **kw}

    def tput(pool, *fits):
        res = [{"batch_size": b, "median_decode_throughput": t} for b, t in fits]
        return {"results": res + [{"batch_size": 64, "skipped": "pool"}], "kv_pool_tokens": pool}

    rows = {"llama31-8b-60k-bs3-dense": one(0.02), "llama31-8b-60k-bs3-dense-fp8": one(0.0125),
            "llama31-8b-60k-bs3-ds": one(0.008), "llama31-8b-60k-bs3-ds-fp8": one(0.007),
            "llama31-8b-60k-bs3-dense-fp8-norot": one(0.0120), "llama31-8b-60k-bs3-ds-fp8-norot": one(0.0068),
            "tput-32k-ds": tput(480000, (8, 900.0), (14, 1500.0)),
            "tput-32k-ds-fp8": tput(960000, (14, 1550.0), (28, 2800.0))}
    s = bench_run.summarize("fp8-kv", rows)
    assert s["fp8_kv_dense_speedup_60k_bs3"] == pytest.approx(1.6)
    assert s["fp8_kv_dense_over_floor_60k_bs3"] == pytest.approx(12.5)
    assert s["fp8_kv_ds_max_throughput_gain_32k"] == pytest.approx(2800 / 1500)
    assert (s["max_batch_32k_bf16"], s["max_batch_32k_fp8"]) == (14, 28)
    assert s["fp8_kv_pool_tokens_ratio"] == 2.0
    assert s["fp8_kv_rotation_step_ratio_dense_60k_bs3"] == pytest.approx(0.0125 / 0.0120)
    assert s["fp8_kv_rotation_step_ratio_ds_60k_bs3"] == pytest.approx(0.007 / 0.0068)


def test_accuracy_summaries_take_the_fp8_kv_rows():
    """The accuracy suite's fp8 K/V row (doublesparse eval rows: dense, the default, both over fp8)
    adds its keys beside the protocol's; accuracy-long's fp8 rows give the largest increases."""
    def row(name, ppl):
        return {"setting": name, "ppl": ppl, "kl": 0.0, "top1": 1.0}

    d = "qk/group_max/r16/k1:16"
    f8 = {"rows": [row("dense", 20.0), row(d, 20.4), row("dense/kv:fp8_e4m3", 20.05), row(d + "/kv:fp8_e4m3", 20.5)]}
    s = bench_run.summarize("accuracy", {"protocol": {"summary": {"default_setting": d}}, "fp8-kv-text-8192": f8})
    assert s["default_setting"] == d and s["fp8_kv_ppl_increase_pct_8192"] == pytest.approx(0.25)
    assert s["fp8_kv_ds_ppl_points_8192"] == pytest.approx(0.5)
    assert "fp8_kv_ppl_increase_pct_8192" not in bench_run.summarize("accuracy", {"protocol": {"summary": {}}})
    long = {"smollm2-8k": {"summary": {"fp8_kv_ppl_increase_pct_8192": 0.3, "fp8_kv_ds_ppl_points_8192": 0.1}},
            "qwen15b-16k-fp8-kv": {"summary": {"fp8_kv_ppl_increase_pct_16384": 0.2,
                                               "fp8_kv_ds_ppl_points_16384": 0.4}}}
    s = bench_run.summarize("accuracy-long", long)
    assert s["fp8_kv_ppl_increase_pct_max"] == 0.3 and s["fp8_kv_ds_ppl_points_max"] == 0.4


@pytest.mark.parametrize("suite", sorted(bench_run.SUITES))
def test_server_rows_say_dense_or_ds(suite):
    """The server decodes with Double Sparsity by default: a row named dense must turn it off,
    and a row named ds must run it."""
    for r in bench_run.suite_commands(suite):
        if not r["server_argv"]:
            continue
        ns = parse(r["server_argv"])
        words = set(r["name"].split("-"))
        if "dense" in words:
            assert ns.enable_double_sparsity is False, (suite, r["name"])
        if "ds" in words:
            assert ns.enable_double_sparsity is not False, (suite, r["name"])
