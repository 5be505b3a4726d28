"""Where a decode step's GPU time goes, by kernel class, from bench_one_batch ``--profile`` results.

    python benchmarks/step_breakdown.py RESULT.json [...] [--dense DENSE.json --targets 1.85]

Per file: the median decode latency, the GPU-only step time, the kernel time per step of the
attention kernels (dense or Double Sparsity: score, select phases, attention, merge), of the
projections (cuBLAS / Triton GEMM kernels with their split-K reductions) and of everything else
(norms, RoPE + store, SiLU-mul, ...), per step and per layer, and the weights' byte floor (weight
bytes / the run's copy bandwidth). With ``--dense``: each file's decode speedup over that run (median
decode latencies, as bench-one-batch-h200.json's summary) and the DS step each target needs.
"""

from __future__ import annotations

import argparse
import json
import re

ATTENTION = re.compile(r"score|hist_high|hist_low|compact|select|decode_attn|merge")
PROJECTION = re.compile(r"nvjet|gemm|gemv|splitKreduce|cutlass|sm90_xmma")


def load(path):
    with open(path) as f:
        data = json.load(f)
    return data, data["results"][0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--dense", default=None)
    ap.add_argument("--targets", default="")
    a = ap.parse_args(argv)
    dense_lat = load(a.dense)[1]["median_decode_latency"] if a.dense else None
    for path in a.paths:
        meta, r = load(path)
        p = r["profile"]
        cls = {"attention": 0.0, "projections": 0.0, "other": 0.0}
        layers = 0
        for k in p["kernels"]:
            name = k["name"]
            kind = "attention" if ATTENTION.search(name) else "projections" if PROJECTION.search(name) else "other"
            cls[kind] += k["us_per_step"]
            if "rope_store" in name:
                layers = int(k["calls_per_step"])
        floor_ms = meta["weight_bytes"] / meta["copy_bandwidth"] * 1e3
        print(f"{path}: decode median {r['median_decode_latency'] * 1e3:.3f} ms, GPU step "
              f"{p['gpu_step_median_s'] * 1e3:.3f} ms, kernels {sum(cls.values()) / 1e3:.3f} ms; weights floor {floor_ms:.3f} ms")
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
