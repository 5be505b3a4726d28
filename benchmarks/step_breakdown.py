"""Where a decode step's GPU time goes, by kernel class, from bench_one_batch ``--profile`` results.

    python benchmarks/step_breakdown.py RESULT.json [...] [--dense DENSE.json --targets 1.85]
    python benchmarks/step_breakdown.py results/bench-one-batch-h200.json \
        --dense results/bench-one-batch-h200.json:llama31-8b-60k-bs3-dense

A RESULT is one ``python -m doublesparse.bench_one_batch --profile --result-json`` file (the
``one-batch`` suite leaves them in ``results/raw/bench-one-batch-<machine>/``), or a suite result
(``results/bench-one-batch-<machine>.json``, written by ``benchmarks/run.py``): every row of it
that has a profile, or one row as ``FILE.json:ROW``. Per result: the median decode latency, the
GPU-only step time, the kernel time per step of the attention kernels (dense, latent or Double
Sparsity: score, select phases, attention, merge), of the routed experts (MoE), of the router's
softmax / top-k / routing layout, of the projections (cuBLAS / Triton GEMM kernels with
their split-K reductions) and of everything else (norms, RoPE + store, SiLU-mul, ...), per step
and per layer, and the weights' byte floor (weight bytes / the run's copy bandwidth). With
``--dense``: each result's decode speedup over that run (median decode latencies, as the suite
result's summary) and the DS step each target needs.
"""

from __future__ import annotations

import argparse
import json
import os
import re

ATTENTION = re.compile(r"score|hist_high|hist_low|compact|select|decode_attn|latent_attn|merge")
# the routed experts' Triton kernels (decode path, grouped GEMM), checked before the projections
EXPERTS = re.compile(r"moe_decode|_gate_up_kernel|_down_kernel|_moe_sum_kernel")
# the router after its gate GEMM (a projection by name): softmax, top-k, and the grouped GEMM's
# routing layout (sort, counts, scans, searchsorted; a sampler's sort in the step would count here too),
# or their one-launch kernels
ROUTER = re.compile(r"softmax|topk|[Ss]ort|scatter_add|searchsorted|[Ss]can|cumsum|_moe_route_kernel|_moe_align_kernel")
PROJECTION = re.compile(r"nvjet|gemm|gemv|splitKreduce|cutlass|sm90_xmma")
CLASSES = (("attention", ATTENTION), ("experts", EXPERTS), ("router", ROUTER), ("projections", PROJECTION))


def kernel_class(name: str) -> str:
    """The class of a kernel by its name: attention, experts, router, projections or other."""
    return next((c for c, pat in CLASSES if pat.search(name)), "other")


def load(spec: str) -> list[tuple[str, dict, dict]]:
    """(name, command JSON, its first result) of each bench_one_batch run in ``spec``: a result
    file, a suite result (all rows with a profile) or ``SUITE.json:ROW``."""
    path, _, row = spec.partition(":") if not os.path.exists(spec) else (spec, "", "")
    with open(path) as f:
        data = json.load(f)
    if "rows" not in data:  # one bench_one_batch result
        return [(spec, data, data["results"][0])]
    rows = data["rows"]
    if row:
        if row not in rows:
            raise SystemExit(f"{path} has no row {row!r}; rows: {sorted(rows)}")
        rows = {row: rows[row]}
    return [(f"{path}:{name}", d, d["results"][0]) for name, d in rows.items()
            if d.get("results") and (row or d["results"][0].get("profile"))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--dense", default=None, help="the dense run to compare with (FILE.json or SUITE.json:ROW)")
    ap.add_argument("--targets", default="", help="comma-separated speedups: the decode step each needs")
    a = ap.parse_args(argv)
    if a.dense:
        dense = load(a.dense)
        if len(dense) != 1:
            raise SystemExit(f"--dense {a.dense}: name one run (FILE.json:ROW for a suite result)")
        dense_lat = dense[0][2]["median_decode_latency"]
    else:
        dense_lat = None
    for path, meta, r in (run for spec in a.paths for run in load(spec)):
        p = r.get("profile")
        if not p:
            raise SystemExit(f"{path}: no profile (run bench_one_batch with --profile)")
        cls = {c: 0.0 for c, _ in CLASSES} | {"other": 0.0}
        layers = 0
        for k in p["kernels"]:
            name = k["name"]
            cls[kernel_class(name)] += k["us_per_step"]
            if "rope_store" in name:
                layers = int(k["calls_per_step"])
        floor_ms = meta["weight_bytes"] / meta["copy_bandwidth"] * 1e3
        # bench.family_decode's floor (touched experts, the cache) where the result has one
        floor = (f"step floor {r['floor']['floor_s'] * 1e3:.3f} ms" if r.get("floor")
                 else f"weights floor {floor_ms:.3f} ms")
        print(f"{path}: decode median {r['median_decode_latency'] * 1e3:.3f} ms, GPU step "
              f"{p['gpu_step_median_s'] * 1e3:.3f} ms, kernels {sum(cls.values()) / 1e3:.3f} ms; {floor}")
        if sum(cls.values()) > p["gpu_step_median_s"] * 1e6:
            print("  (the kernels overlap: under PDL a kernel launched early counts its wait, e.g. the norms"
                  " and SiLU-mul behind skinny.py's GEMMs; the classes below are not additive)")
        for kind, us in cls.items():
            per_layer = f" ({us / layers:.1f} us per layer of {layers})" if layers else ""
            print(f"  {kind:12s} {us / 1e3:7.3f} ms{per_layer}")
        if dense_lat:
            print(f"  speedup over {a.dense}: {dense_lat / r['median_decode_latency']:.3f}")
            for t in (float(x) for x in a.targets.split(",") if x):
                print(f"  target {t}: decode step {dense_lat / t * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
