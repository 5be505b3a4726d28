"""Probe: where the CUDA label scores' time goes (kernels/cuda/score.cu on CUDA cores, score_tc.cu
on tensor cores), one layer, Llama-3.1-8B shapes (8 KV heads, G 4, r 16, bf16 labels or, for a
case "BxLfp8", fp8; group_max),
against the Triton score (score_impl mma).

    python benchmarks/score_cuda_probe.py [--cases 3x65536,16x32768] [--rounds N] [--copies C]
        [--geometries all|depth] [--variants loads,products,full,no-hist] [--json OUT.json]

Variants (the sources' PROBE define): "loads" (label rows and slots only), "products" (also the
dot products, no stores), "full" (stores and the fused histogram), "no-hist". Each is timed alone in a CUDA graph (median of
replays, as bench.attention times DS) for several geometries (programs per SM, rows per thread or
tiles per warp, min blocks). Label bytes / time gives the fraction of the copy bandwidth measured
in the same run. Each graph rotates over ``--copies`` independent batches (default 4), so that the
labels it reads do not stay in L2 between calls (session 19's call g, with one copy, measured fp8
labels partly from L2).
"""

from __future__ import annotations

import argparse
import math

import torch

from doublesparse.bench.attention import HKV, D, copy_bandwidth, time_fn
from doublesparse.kernels.cuda import score as cuda_score
from doublesparse.kernels.triton import launch
from probe_lib import layer_cases, write_json

VARIANTS = {"loads": (("PROBE", 1),), "products": (("PROBE", 2),), "full": (), "no-hist": ()}
# Session 20's call e also had "full-late" (("EARLY_ROWS", 0),), the first label rows requested
# after the query's B fragments against "full" before them (score_tc.cu in 9ba6f09); removed.
# (tc, programs per SM, rows per thread / tiles per warp, min blocks, ring depth of score_tc.cu)
GEOMETRIES = {
    "all": ((False, 2, 4, 2, 2), (True, 2, 4, 2, 2), (True, 2, 8, 2, 2), (True, 3, 2, 3, 2), (True, 4, 1, 4, 2)),
    # session 20: score_tc.cu's ring of label rows, deeper (tiles capped by score.py's RING_WORDS)
    "depth": ((True, 2, 4, 2, 2), (True, 2, 2, 2, 3), (True, 2, 2, 2, 4), (True, 2, 1, 2, 8), (True, 2, 4, 2, 3),
              (True, 2, 4, 2, 4)),
    "s20": ((True, 2, 2, 2, 3), (True, 2, 4, 2, 2)),
}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="3x65536,16x32768")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=1, help="time every variant this many times, in turn")
    ap.add_argument("--copies", type=int, default=4, help="independent batches each graph rotates over")
    ap.add_argument("--geometries", choices=sorted(GEOMETRIES), default="all")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"# {torch.cuda.get_device_name(dev)} copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    T = launch.TUNING
    default_impl = T["score_impl"]
    rows = []
    C = args.copies
    for B, L, k, p, ws in layer_cases(args.cases, dev, C):
        sm = 1 / math.sqrt(D)
        lab_bytes = B * L * HKV * 16 * p.labels.element_size()
        T["score_impl"] = "mma"
        t = time_fn(lambda i=0: launch.ds_decode(p.q, p.k, p.v, p.labels, p.scale, p.channels, p.req_to_token,
                                                 p.req_idx[i], p.seq_lens, sm, k, "group_max", ws=ws, stage="score"),
                    C)
        res = {"triton-mma": t * 1e6}
        T["score_impl"] = default_impl
        nsm = torch.cuda.get_device_properties(dev).multi_processor_count
        geoms = GEOMETRIES[args.geometries]
        for rnd, (tc, per_sm, per, minb, depth) in ((r, g) for r in range(args.rounds) for g in geoms):
            P = max(1, min(-(-per_sm * nsm // B), -(-L // cuda_score.step_tokens(p.q, p.labels, per, tc, depth))))
            # the geometry the launcher builds (tiles and depth capped by registers)
            _, lt, dep = cuda_score._tc_geometry(p.q, p.labels, per, depth) if tc else (0, per, 0)
            for name in args.variants.split(","):
                key = (f"{'tc' if tc else 'cc'} {name} P/SM {per_sm} per {lt} minb {minb} depth {dep}"
                       + (f" r{rnd}" if rnd else ""))
                if key in res:  # a requested geometry capped to one already timed in this round
                    continue
                hist = not name.startswith("no-hist")

                def call(i=0, extra=VARIANTS[name]):
                    cuda_score.score(p.q, p.labels, p.scale, p.channels, p.req_to_token, p.req_idx[i], p.seq_lens,
                                     ws.scores, ws.hist, sm, k, 0, 0, 0, "group_max", P, hist, per, minb, tc, depth,
                                     extra=extra)
                res[key] = time_fn(call, C) * 1e6
                ws.hist.zero_()
        print(f"bs{B} L={L} {p.labels.dtype}: label bytes {lab_bytes / 1e6:.1f} MB, floor {lab_bytes / bw * 1e6:.1f} us", flush=True)
        for n, us in res.items():
            print(f"  {n:38s} {us:7.1f} us  bw {lab_bytes / (us / 1e6) / bw:.2f}", flush=True)
        rows.append(dict(batch=B, ctx=L, label=str(p.labels.dtype), label_bytes=lab_bytes, copy_bw=bw, us=res))
    write_json(args.json, "score_cuda_probe.py", rows)


if __name__ == "__main__":
    main()
