"""``python -m doublesparse.bench.moe_experts``: the routed experts of one MoE layer alone at decode
sizes, the decode path (kernels/triton/moe_decode.py) beside the grouped GEMM (moe.py), and the
grouped GEMM with its block layout built by device ops (``fused_moe_routing`` off: the peer of its
one-launch layout).

Per model shape and token count: random bf16 expert weights, tokens routed uniformly at random
(top-k of random router logits, as dummy weights route), both paths replayed from CUDA graphs (as
decode runs), median time per call. Bytes are the touched experts' weights (gate, up and down of
every expert that received a token; the activations are ~1000x smaller), reported as GB/s and as a
fraction of the copy bandwidth (``bench_one_batch``'s probe, read + write counted, as the models
suite's floors). The shared experts and the router are not part of the path timed here.

    python -m doublesparse.bench.moe_experts [--tokens 4 16 64] [--result-json r.json]
        [--kernel-tuning FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ..kernels import ops
from ..kernels.tuning import KernelTuning
from .attention import time_fn
from .one_batch import copy_bandwidth

# name -> (hidden, moe intermediate, routed experts, top-k)
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v2-lite": (2048, 1408, 64, 6)}


def time_graph(fn, iters: int, reps: int = 10) -> float:
    """Median seconds of one ``fn()`` call: ``reps`` calls captured in one CUDA graph, replayed
    (the eager first call in ``time_fn`` also makes the decode path's counters before capture)."""
    return time_fn(lambda *_: fn(), reps=reps, iters=iters)


def case(name: str, T: int, tuning: KernelTuning, bw: float, iters: int, seed: int = 0, device: str = "cuda",
         shape: tuple | None = None, timer=time_graph, dtype=torch.bfloat16) -> dict:
    """One row; ``device``, ``shape`` (hidden, intermediate, experts, top-k), ``timer`` and
    ``dtype`` let the tests run it on the CPU under the interpreter."""
    H, inter, E, K = shape or SHAPES[name]
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(T, H, device=dev, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, device=dev, generator=g) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, device=dev, generator=g) * inter ** -0.5).to(dtype)
    weights, ids = torch.randn(T, E, device=dev, generator=g).softmax(-1).topk(K)
    touched = int(ids.unique().numel())
    nbytes = touched * 3 * H * inter * w13.element_size()
    grouped = tuning.replace(moe_decode_max_tokens=0)
    decode = tuning.replace(moe_decode_max_tokens=max(tuning.moe_decode_max_tokens, T))
    ops_layout = grouped.replace(fused_moe_routing=False)
    paths = {"decode": lambda: ops.moe_experts(x, w13, w2, weights, ids, impl="triton", tuning=decode),
             "grouped": lambda: ops.moe_experts(x, w13, w2, weights, ids, impl="triton", tuning=grouped),
             # the peer: the grouped GEMM with its block layout by ~25 small device ops
             "grouped_ops": lambda: ops.moe_experts(x, w13, w2, weights, ids, impl="triton", tuning=ops_layout)}
    want = paths["grouped"]().float()
    got = paths["decode"]().float()
    row = {"model": name, "tokens": T, "top_k": K, "experts": E, "touched_experts": touched,
           "touched_bytes": nbytes, "max_rel_diff": float((got - want).abs().max() / want.abs().max())}
    for p, fn in paths.items():
        s = timer(fn, iters)
        row.update({f"{p}_us": s * 1e6, f"{p}_gbs": nbytes / s / 1e9, f"{p}_bw_frac": nbytes / s / bw})
    return row


def fixed_cost(rows: list[dict]) -> dict:
    """Per path timed and model, the line through (touched bytes, time) at the model's two smallest
    token counts: ``{path: {model: {"stream_gbs", "fixed_us"}}}``, the rate the path streams the
    experts at and the time a call takes beyond that (launches, routing layout, sum)."""
    out: dict = {}
    for path in ("decode", "grouped", "grouped_ops"):
        for model in dict.fromkeys(r["model"] for r in rows if f"{path}_us" in r):
            two = sorted((r for r in rows if r["model"] == model and f"{path}_us" in r), key=lambda r: r["tokens"])[:2]
            if len(two) < 2 or two[1][f"{path}_us"] <= two[0][f"{path}_us"]:
                continue
            a, b = two
            us = b[f"{path}_us"] - a[f"{path}_us"]
            rate = (b["touched_bytes"] - a["touched_bytes"]) / us  # bytes per us
            out.setdefault(path, {})[model] = {"stream_gbs": rate / 1e3, "fixed_us": a[f"{path}_us"] - a["touched_bytes"] / rate}
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m doublesparse.bench.moe_experts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[4, 16, 64])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--kernel-tuning", default=None, metavar="FILE.json", help="KernelTuning fields to override")
    ap.add_argument("--result-json", default=None)
    return ap


def table(res: dict) -> list[str]:
    """Markdown rows of a result (the models suite's expert-path table)."""
    L = ["| model | tokens | touched experts | MB | decode path us | GB/s | of copy | grouped GEMM us | GB/s | of copy "
         "| grouped, layout by device ops us | of copy |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("rows", []):
        ops_cols = (f"{r['grouped_ops_us']:.1f} | {r['grouped_ops_bw_frac']:.2f}" if "grouped_ops_us" in r else "- | -")
        L.append(f"| {r['model']} | {r['tokens']} | {r['touched_experts']} | {r['touched_bytes'] / 1e6:.0f} | "
                 f"{r['decode_us']:.1f} | {r['decode_gbs']:.0f} | {r['decode_bw_frac']:.2f} | {r['grouped_us']:.1f} | "
                 f"{r['grouped_gbs']:.0f} | {r['grouped_bw_frac']:.2f} | {ops_cols} |")
    return L


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_experts: CUDA only", file=sys.stderr)
        return 2
    tuning = KernelTuning.from_json(a.kernel_tuning) if a.kernel_tuning else KernelTuning()
    bw = copy_bandwidth(torch.device("cuda"), 1 << 30)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'model':18} {'T':>3} {'touched':>7} {'MB':>7} | {'decode us':>9} {'GB/s':>6} {'frac':>5} | "
          f"{'grouped us':>10} {'GB/s':>6} {'frac':>5} | rel diff")
    rows = []
    for name in a.models:
        for T in a.tokens:
            r = case(name, T, tuning, bw, a.iters)
            torch.cuda.empty_cache()  # the case's weights
            rows.append(r)
            print(f"{name:18} {T:3d} {r['touched_experts']:7d} {r['touched_bytes'] / 1e6:7.1f} | "
                  f"{r['decode_us']:9.1f} {r['decode_gbs']:6.0f} {r['decode_bw_frac']:5.2f} | "
                  f"{r['grouped_us']:10.1f} {r['grouped_gbs']:6.0f} {r['grouped_bw_frac']:5.2f} | "
                  f"{r['max_rel_diff']:.1e} | layout by device ops {r['grouped_ops_us']:.1f} us", flush=True)
    # the expert path is the one the tuning takes at each size (kernels/triton/moe_decode.decode_fits)
    default = lambda r: "decode" if tuning.moe_decode_max_tokens >= r["tokens"] else "grouped"  # noqa: E731
    summary = {"expert_path_bw_frac_min": min(r[f"{default(r)}_bw_frac"] for r in rows),
               "decode_path_bw_frac_min": min(r["decode_bw_frac"] for r in rows),
               "grouped_bw_frac_min": min(r["grouped_bw_frac"] for r in rows),
               "grouped_ops_bw_frac_min": min(r["grouped_ops_bw_frac"] for r in rows), "fit": fixed_cost(rows)}
    print(json.dumps(summary))
    if a.result_json:
        with open(a.result_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth": bw, "kernel_tuning": tuning.asdict(),
                       "rows": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
