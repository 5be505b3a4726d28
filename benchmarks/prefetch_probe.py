"""Experiment: load the o_proj weights into L2 during the DS select (``ds_decode(prefetch=W)``,
TUNING["ds_prefetch"]) so that the o_proj GEMM after the attention reads L2.

    python benchmarks/prefetch_probe.py [--cases 3x65536,3x131072] [--rounds 5] [--json OUT.json]

Per case (one Llama-3.1-8B layer, r 16, k = L/16, group_max) two CUDA graphs, replayed back to
back and alternated round by round: (flush L2 with a 256 MB read, DS decode, o_proj [B, 4096] x
[4096, 4096] through the engine's GEMM) without and with the prefetch, and the flush alone; the
flush is subtracted. The flush stands for the ~430 MB of other weights a decode step reads between
one layer's o_proj and the next.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from doublesparse.kernels.triton import launch
from doublesparse.kernels.triton.fused_launch import skinny_gemm
from probe_lib import layer_cases, read, write_json


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="3x65536,3x131072")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--programs", default="528", help="comma-separated TUNING ds_prefetch_programs to try")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    sink = torch.zeros(4096, device=dev)
    flush = torch.randn(128 << 20, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16) * 0.02
    rows = []
    for B, L, k, p, ws in layer_cases(args.cases, dev):
        sm = 1 / math.sqrt(128)

        def step(prefetch):
            read(flush, sink, "")
            o = launch.ds_decode(p.q, p.k, p.v, p.labels, p.scale, p.channels, p.req_to_token, p.req_idx[0],
                                 p.seq_lens, sm, k, "group_max", ws=ws, out=p.out,
                                 prefetch=w if prefetch else None)
            skinny_gemm(o.view(B, -1), w)

        launch.TUNING["ds_prefetch"] = True
        outs = {}
        for pf in (False, True):
            step(pf)
            torch.cuda.synchronize()
            outs[pf] = p.out.clone()
        assert torch.equal(outs[False], outs[True]), "the prefetch changed the attention output"
        graphs = {}
        variants = [("flush", lambda: read(flush, sink, "")), ("plain", lambda: step(False))]
        variants += [(f"prefetch{n}", lambda: step(True), int(n)) for n in args.programs.split(",")]
        for name, fn, *progs in variants:
            if progs:
                launch.TUNING["ds_prefetch_programs"] = progs[0]
                fn()  # compile outside the capture
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            graphs[name] = g
        times = {n: [] for n in graphs}
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(args.rounds):
            for name, g in graphs.items():
                a.record()
                for _ in range(args.replays):
                    g.replay()
                b.record()
                torch.cuda.synchronize()
                times[name].append(a.elapsed_time(b) * 1e3 / args.replays)
        fl = statistics.median(times["flush"])
        for name in [n for n in graphs if n != "flush"]:
            us = statistics.median(times[name]) - fl
            rows.append(dict(batch=B, ctx=L, k=k, case=name, us=us, rounds=[t - fl for t in times[name]]))
            print(f"{B}x{L} k{k} {name:9s} DS + o_proj {us:7.2f} us (rounds {[round(t - fl, 1) for t in times[name]]})",
                  flush=True)
        del p, ws, graphs
        torch.cuda.empty_cache()
    write_json(args.json, "prefetch_probe.py", rows)


if __name__ == "__main__":
    main()
