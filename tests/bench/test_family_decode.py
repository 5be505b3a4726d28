"""bench.family_decode (decode against its byte floor, touched experts counted) on a tiny MoE on
CPU, and the `models` suite's summary and table built from its output."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from doublesparse.bench import family_decode
from doublesparse.testing import tiny_family_hf_config

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_run", ROOT / "benchmarks" / "run.py")
bench_run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_run)

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(tmp_path, name, *extra):
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(tiny_family_hf_config("qwen3_moe", max_position_embeddings=256)))
    out = tmp_path / f"{name}.json"
    rc = family_decode.main(["--model-path", str(cfg), "--load-format", "dummy", "--device", "cpu", "--batch-size", "3",
                             "--input-len", "41", "--output-len", "4", "--fill", "random", "--skip-warmup",
                             "--floor-steps", "2", "--copy-bytes", "1000000", "--result-json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_floor_and_models_summary(tmp_path, capsys):
    dense = _run(tmp_path, "dense")
    ds = _run(tmp_path, "ds", "--enable-double-sparsity", "--ds-heavy-token-num", "8",
              "--ds-sparse-decode-threshold", "0")
    assert "Floor. " in capsys.readouterr().out
    d, x = dense["results"][0], ds["results"][0]
    f = d["floor"]
    assert 1 <= f["touched_experts_mean"] <= 6 and len(f["observed_steps"]) == 2
    assert f["floor_bytes"] == f["static_weight_bytes"] + f["expert_bytes"] + f["attention_bytes"]
    kv_per_token = 2 * 2 * 2 * 16 * 4  # K and V x layers x kv heads x head_dim x float32
    assert f["attention_bytes"] == 3 * 43 * kv_per_token  # the median step's lengths (41 + 2)
    assert x["floor"]["attention_bytes"] < f["attention_bytes"] and x["sparse_steps"] == 3
    assert f["static_weight_bytes"] < dense["weight_bytes"]
    rows = {f"{stem}-{v}": (dense if v == "dense" else ds) for stem in bench_run._FAMILY_CASES for v in ("dense", "ds")}
    expert = {"model": "qwen3-30b-a3b", "tokens": 4, "touched_experts": 30, "touched_bytes": 283e6, "decode_us": 100.0,
              "decode_gbs": 2830.0, "decode_bw_frac": 0.85, "grouped_us": 190.0, "grouped_gbs": 1490.0,
              "grouped_bw_frac": 0.45}
    rows["expert-path"] = {"rows": [expert], "summary": {"expert_path_bw_frac_min": 0.85}}
    s = bench_run.summarize("models", rows)
    assert s["expert_path_bw_frac_min"] == 0.85 and s["expert_path_fit"] == {}   # one token count: no line
    # the line through the two smallest token counts: 10 + bytes / 2 GB/s (bytes per us = GB/s x 1e3)
    from doublesparse.bench.moe_experts import fixed_cost
    line = [{"model": "m", "tokens": t, "touched_bytes": b, "grouped_us": 10 + b / 2e3} for t, b in ((16, 8e5), (4, 2e5),
                                                                                                  (64, 9e5))]
    fit = fixed_cost(line)["grouped"]["m"]
    assert fit["stream_gbs"] == pytest.approx(2.0) and fit["fixed_us"] == pytest.approx(10.0)
    for key in ("dsv2_lite_128k_bs4_ds_speedup", "dsv2_lite_dense_over_floor", "qwen3_moe_32k_bs8_ds_speedup",
                "qwen3_moe_dense_over_floor", "mixtral_32k_bs8_ds_speedup", "mixtral_dense_over_floor"):
        assert s[key] is not None and s[key] > 0, key
    doc = {"suite": "models", "area": "models", "machine": "GPU X", "date": "d", "commit": "c", "summary": s,
           "rows": rows, "commands": ["x"]}
    md = bench_run.markdown(doc)
    assert "| dsv2-lite-128k-bs4-ds |" in md and "floor ms" in md
    assert "| qwen3-30b-a3b | 4 | 30 | 283 | 100.0 | 2830 | 0.85 |" in md and "| expert-path |" not in md


def test_moe_experts_bench_needs_cuda():
    from doublesparse.bench import moe_experts
    a = moe_experts.build_parser().parse_args(["--tokens", "4", "--models", "deepseek-v2-lite"])
    assert a.tokens == [4] and a.models == ["deepseek-v2-lite"]
    if not torch.cuda.is_available():
        assert moe_experts.main(["--tokens", "4"]) == 2


def test_moe_experts_case_on_cpu():
    """One row of the bench at a tiny shape (float32, on the GPU or the interpreter, whose bf16
    tl.dot is not the GPU's; a stand-in timer): both paths agree, bytes are the touched experts' weights."""
    from doublesparse.bench import moe_experts
    from doublesparse.kernels.tuning import KernelTuning
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors reach Triton only interpreted
    r = moe_experts.case("tiny", 3, KernelTuning(fused_moe=True), bw=1e9, iters=1, device=dev,
                         shape=(40, 24, 7, 2), timer=lambda fn, iters: fn() is not None and 1e-3, dtype=torch.float32)
    assert 1 <= r["touched_experts"] <= 6 and r["touched_bytes"] == r["touched_experts"] * 3 * 40 * 24 * 4
    assert r["max_rel_diff"] < 1e-4 and r["decode_gbs"] == r["touched_bytes"] / 1e-3 / 1e9
    assert r["grouped_ops_us"] == r["grouped_us"] == 1e3   # the peer with its layout by device ops, timed too
    assert moe_experts.table({"rows": [r]})[-1].endswith("| 1000.0 | 0.05 |")


def test_step_breakdown_classes(tmp_path, capsys):
    """benchmarks/step_breakdown.py on a family_decode-shaped result: every kernel in one class."""
    spec_b = importlib.util.spec_from_file_location("step_breakdown", ROOT / "benchmarks" / "step_breakdown.py")
    sb = importlib.util.module_from_spec(spec_b)
    spec_b.loader.exec_module(sb)
    names = {"moe_decode_gate_up_kernel": "experts", "_down_kernel": "experts", "latent_attn_kernel": "attention",
             "decode_attn_kernel": "attention", "void at::native::sbtopk::gatherTopK<float>": "router",
             "softmax_warp_forward": "router", "skinny_gemm_kernel": "projections", "nvjet_tst_64x8": "projections",
             "rmsnorm_kernel": "other"}
    assert {n: sb.kernel_class(n) for n in names} == names
    one_launch = {"_moe_sum_kernel": "experts", "_moe_align_kernel": "router", "_moe_route_kernel": "router"}
    assert {n: sb.kernel_class(n) for n in one_launch} == one_launch
    kernels = [{"name": n, "us_per_step": 10.0, "calls_per_step": 2} for n in names]
    res = {"weight_bytes": 1e9, "copy_bandwidth": 1e12,
           "results": [{"median_decode_latency": 2e-4, "floor": {"floor_s": 1e-4},
                        "profile": {"gpu_step_median_s": 1.5e-4, "kernels": kernels}}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(res))
    sb.main([str(path)])
    out = capsys.readouterr().out
    assert "step floor 0.100 ms" in out and "experts        0.020 ms" in out and "router         0.020 ms" in out
