"""bench.hf_offload (transformers' offloaded-cache peer) on the tiny config on CPU: the sweep's JSON,
its stops (budget, positions), and its prefill + decode loop against transformers' own generate."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from doublesparse.bench import hf_offload

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_run", ROOT / "benchmarks" / "run.py")
bench_run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_run)

pytestmark = pytest.mark.usefixtures("one_thread")


def _main(tmp_path, *argv):
    out = tmp_path / "r.json"
    assert hf_offload.main(["--tiny", "--device", "cpu", "--result-json", str(out), *argv]) == 0
    return json.loads(out.read_text())


def test_sweep_json(tmp_path, capsys):
    doc = _main(tmp_path, "--lengths", "40", "97", "--decode-steps", "3", "--prefill-chunk", "32",
                "--batch-size", "2")
    assert "longest finished" in capsys.readouterr().out
    assert doc["architecture"] == "LlamaForCausalLM" and doc["cache_implementation"] == "offloaded"
    assert [r["status"] for r in doc["results"]] == ["ok", "ok"]
    r = doc["results"][1]
    assert r["cache"] == "dynamic"  # CPU: transformers' offloading needs CUDA streams
    assert len(r["step_ms"]) == len(r["tokens"]) == 3 and r["median_step_ms"] > 0
    assert r["kv_gib"] * 2**30 == 2 * 2 * 2 * 97 * 2 * 16 * 4  # K+V x layers x batch x L x Hkv x D x fp32
    s = doc["summary"]
    assert s["longest_length"] == 97 and s["median_step_ms"] == r["median_step_ms"] and s["batch_size"] == 2
    summary = bench_run.summarize("offload", {"hf-offloaded-cache": doc})
    assert {k: summary[k] for k in ("hf_offload_longest_length", "hf_offload_step_ms")} == \
        {"hf_offload_longest_length": 97, "hf_offload_step_ms": r["median_step_ms"]}


def test_stops_at_budget_and_positions(tmp_path):
    doc = _main(tmp_path, "--lengths", "16", "64", "--decode-steps", "2", "--budget-s", "0")
    assert [r["status"] for r in doc["results"]] == ["over_budget"] and doc["summary"]["longest_length"] is None
    doc = _main(tmp_path, "--lengths", "16", "64", "--decode-steps", "2", "--total-budget-s", "0")
    assert [r["status"] for r in doc["results"]] == ["skipped"] and "left" in doc["results"][0]["reason"]
    doc = _main(tmp_path, "--fill", "random", "--lengths", "16", "4096", "--decode-steps", "2")
    assert [r["status"] for r in doc["results"]] == ["ok", "skipped"]  # tiny-llama has 2048 positions
    assert "positions" in doc["results"][1]["reason"] and doc["summary"]["longest_length"] == 16
    for bad in (["--lengths", "64", "16"], ["--decode-steps", "0"]):
        with pytest.raises(SystemExit):
            hf_offload.main(["--tiny", "--device", "cpu", *bad])
    prev = {"status": "ok", "length": 1000, "elapsed_s": 10.0}
    assert hf_offload.projected_s(prev, 4000) == 40.0 and hf_offload.projected_s(None, 4000) == 0.0


def test_loop_matches_generate_and_random_fill_length():
    config = hf_offload.hf_config("tiny-llama")
    cpu = torch.device("cpu")
    model = hf_offload.build_model(config, cpu, torch.float32, seed=3)
    ids = torch.randint(0, config.vocab_size, (3, 45), generator=torch.Generator().manual_seed(0))
    cache, kind = hf_offload.new_cache(config, "offloaded", cpu)
    with torch.inference_mode():
        tok = hf_offload.fill_prefill(model, cache, ids, 16, deadline=float("inf"))
        _, ours = hf_offload.decode(model, cache, tok, 4, deadline=float("inf"))
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert kind == "dynamic" and cache.get_seq_length() == 45 + 4
    assert [int(tok[0, 0]), *ours] == ref[0, 45:].tolist()
    cache, _ = hf_offload.new_cache(config, "dynamic", cpu)
    with torch.inference_mode():
        hf_offload.fill_random(model, cache, 2, 29, torch.Generator().manual_seed(1), deadline=float("inf"))
        times, _ = hf_offload.decode(model, cache, torch.zeros(2, 1, dtype=torch.long), 2, deadline=float("inf"))
    assert cache.get_seq_length() == 31 and len(times) == 2
