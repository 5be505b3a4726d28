"""Experiment: can a decode projection's weights wait in L2 through the DS attention's byte stream?

    python benchmarks/l2_prefetch_probe.py [--rows 16] [--json OUT.json]

Idea (not in the engine): the DS select passes are latency-bound and leave DRAM idle for tens of
µs per layer, while the o_proj that follows reads its 33.5 MB of weights (Llama-3.1-8B) from DRAM.
If those weights were loaded into L2 during the select (evict_last) and the attention's gathered
K/V (~134 MB per layer at 16 x 32K) were read with evict_first, the o_proj would read L2. This
times the o_proj GEMM (``--gemm cublas``: F.linear; ``--gemm skinny``: the engine's split-K Triton
GEMM for <= 4 rows, kernels/triton/skinny.py; [rows, 4096] x [4096, 4096] bf16) alone after each
preparation, in CUDA graphs (a graph of preparation + GEMM against one of the preparation alone,
replayed back to back; the difference per replay), median of repeats:

  cold        L2 flushed (a 256 MB read), then the GEMM
  warm        the weights just read (evict_last), then the GEMM: the bound of the idea
  stream      weights read (evict_last), then STREAM MB read with the default policy, then the GEMM
  stream_ef   the same with the stream read evict_first
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from probe_lib import read, write_json


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--stream-mb", default="67,134")
    ap.add_argument("--shapes", default="4096x4096,6144x4096")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--gemm", choices=["cublas", "skinny"], default="cublas")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    sink = torch.zeros(4096, device=dev)
    flush = torch.randn(128 << 20, device=dev, dtype=torch.bfloat16)  # 256 MB
    streams = {mb: torch.randn(mb << 19, device=dev, dtype=torch.bfloat16) for mb in
               (int(x) for x in args.stream_mb.split(","))}
    if args.gemm == "skinny":
        from doublesparse.kernels.triton.fused_launch import skinny_gemm as gemm
    else:
        gemm = F.linear
    rows = []
    for shape in args.shapes.split(","):
        N, K = (int(x) for x in shape.split("x"))
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        x = torch.randn(args.rows, K, device=dev, dtype=torch.bfloat16)
        preps = {"cold": lambda: read(flush, sink, ""),
                 "warm": lambda: (read(flush, sink, ""), read(w, sink, "evict_last"))}
        for mb, s in streams.items():
            preps[f"stream{mb}"] = lambda s=s: (read(flush, sink, ""), read(w, sink, "evict_last"),
                                                read(s, sink, ""))
            preps[f"stream{mb}_ef"] = lambda s=s: (read(flush, sink, ""), read(w, sink, "evict_last"),
                                                   read(s, sink, "evict_first"))
        for _ in range(3):  # compile and warm up
            for prep in preps.values():
                prep()
            gemm(x, w)
        torch.cuda.synchronize()
        # In CUDA graphs: the host's launch time (Triton's is tens of µs) must not fall between
        # the preparation and the GEMM. GEMM time = (prep + GEMM) - prep, per replay.
        graphs = {}
        for name, prep in preps.items():
            for with_gemm in (False, True):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    prep()
                    if with_gemm:
                        gemm(x, w)
                graphs[name, with_gemm] = g
        times = {k: [] for k in preps}
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 10
        for _ in range(args.repeats):
            for name in preps:  # interleaved, so that drift hits every case alike
                t = {}
                for with_gemm in (False, True):
                    a.record()
                    for _ in range(reps):
                        graphs[name, with_gemm].replay()
                    b.record()
                    torch.cuda.synchronize()
                    t[with_gemm] = a.elapsed_time(b) * 1e3 / reps
                times[name].append(t[True] - t[False])
        floor_us = w.numel() * 2 / 4.26e12 * 1e6
        for name, ts in times.items():
            med = statistics.median(ts)
            rows.append(dict(shape=shape, rows=args.rows, gemm=args.gemm, case=name, us=med, weight_mb=w.numel() * 2 / 1e6,
                             dram_floor_us=floor_us))
            print(f"{shape} rows {args.rows} {args.gemm} {name:12s} {med:7.2f} us  (DRAM floor {floor_us:.2f} us)", flush=True)
    write_json(args.json, "l2_prefetch_probe.py", rows)

if __name__ == "__main__":
    main()
