"""Experiment: a split-K Triton GEMM for decode projections (a few rows), launched with PDL.

    python benchmarks/skinny_gemm_probe.py [--rows 16,3] [--json OUT.json]
    python benchmarks/skinny_gemm_probe.py --summarize OUT.json   # no GPU needed

Why: at 16 decode rows cuBLAS's o_proj of Llama-3.1-8B takes ~11.5 us plus a ~1.9 us split-K
reduce kernel against a 7.9 us DRAM floor, and reads only 2-3 us faster from L2
(benchmarks/l2_prefetch_probe.py): launch and first-load latency, not bytes. In a decode step
every projection follows a kernel that takes part in programmatic dependent launch (RMSNorm,
SiLU-mul, the attention merge; kernels/triton/pdl.py), so a projection launched with PDL could
have its first weight tile in flight before that kernel ends. The kernel (kernels/triton/skinny.py,
which session 14 wrote here and session 18 moved into the package): a grid of (N / BLOCK_N,
SPLIT_K) programs; each loads its first [BLOCK_N, BLOCK_K] weight tile, then waits (PDL), then
runs its K range on tensor cores (x padded to 16 rows); the partial tiles are summed by the last
program of each N tile to arrive (a counter, reset by it), so one launch, no reduce kernel.

Timed (median of repeats, L2 flushed before each by a 1 GB read, long enough (~0.25 ms) for the
host to queue what follows before the GPU gets there, so that launch costs on the host stay out of
the events): a short PDL kernel that stands for the RMSNorm
ahead of a projection, then the projection, between two events. Variants: cuBLAS (F.linear), the
kernel without and with PDL over a few launch shapes (``--configs``; ``""``: none), and as the
engine launches it (``fused_launch.skinny_gemm``: its default split, or each ``--package`` split).
Each Triton result is first checked against F.linear in fp32.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from doublesparse.kernels.triton import fused_launch
from doublesparse.kernels.triton.pdl import enter
from doublesparse.kernels.triton.skinny import skinny_gemm_kernel
from probe_lib import read, write_json


class Skinny:
    """y = x @ w.T for x [M <= 16, K] by the package's kernel at a given launch shape; its
    workspace (partials, counters) allocated once."""

    def __init__(self, N, K, block_n, block_k, split_k, stages, pdl, device):
        self.N, self.K = N, K
        self.cfg = dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, STAGES=stages)
        self.pdl = pdl
        self.part = torch.empty(split_k * 16 * N, dtype=torch.float32, device=device)
        self.cnt = torch.zeros(triton.cdiv(N, block_n), dtype=torch.int32, device=device)

    def __call__(self, x, w, y):
        M = x.shape[0]
        assert M <= 16 and x.shape[1] == self.K and w.shape == (self.N, self.K)
        grid = (triton.cdiv(self.N, self.cfg["BLOCK_N"]), self.cfg["SPLIT_K"])
        kw = dict(launch_pdl=True) if self.pdl else {}
        skinny_gemm_kernel[grid](x, w, w, y, self.part, self.cnt, M, self.N, self.K, x.stride(0), w.stride(0),
                                 y.stride(0), HAS_BIAS=False, DOT_F32=False, PDL=self.pdl, num_warps=4, **self.cfg, **kw)
        return y


@triton.jit
def _pre_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # Stands for the RMSNorm ahead of a projection: waits, lets the next kernel start, copies x.
    enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def summarize(path):
    """Per projection and row count: cuBLAS and the fastest Triton variant (a min over noisy medians,
    so it flatters Triton a little); per row count, the sum over the projections of one layer of
    (cuBLAS - best Triton), with and without the projections where Triton is slower."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    best, gain = {}, {}
    for r in rows:
        key = (r["shape"], r["rows"])
        b = best.setdefault(key, {})
        if r["variant"] == "cublas":
            b["cublas"] = r["us"]
        elif "triton" not in b or r["us"] < b["triton"][0]:
            b["triton"] = (r["us"], r["variant"])
    for (shape, m), b in best.items():
        d = b["cublas"] - b["triton"][0]
        g = gain.setdefault(m, [0.0, 0.0])
        g[0] += d
        g[1] += max(d, 0.0)
        print(f"{shape} rows {m:2d}: cuBLAS {b['cublas']:6.2f} us, best {b['triton'][1]} {b['triton'][0]:6.2f} us")
    for m, (net, kept) in gain.items():
        print(f"rows {m}: per layer (the shapes above once each) {net:+.2f} us; keeping cuBLAS where it is "
              f"faster {kept:+.2f} us")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,3")
    ap.add_argument("--shapes", default="4096x4096,6144x4096,4096x14336,28672x4096",
                    help="NxK: o_proj, qkv, down, gate_up of Llama-3.1-8B")
    ap.add_argument("--configs", default="64:128:4:3,64:128:8:3,32:128:4:3,64:256:4:2,128:128:2:3,64:128:1:3",
                    help="BLOCK_N:BLOCK_K:SPLIT_K:STAGES, each timed with and without PDL")
    ap.add_argument("--package", default="", help="SPLIT_K,... of the package's kernel, each timed")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--summarize", default=None, help="a result file: cuBLAS against the best Triton variant")
    args = ap.parse_args(argv)
    if args.summarize:
        return summarize(args.summarize)
    dev = torch.device("cuda")
    sink = torch.zeros(4096, device=dev)
    flush = torch.randn(512 << 20, device=dev, dtype=torch.bfloat16)  # 1 GB
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    out = []
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        for M in (int(v) for v in args.rows.split(",")):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            x_in = torch.empty_like(x)
            y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            ref = (x.float() @ w.float().T)
            variants = {"cublas": lambda: F.linear(x_in, w)}
            if fused_launch.pdl_enabled(dev):  # the package's kernel as the engine launches it (PDL)
                variants["package skinny_gemm pdl"] = lambda: fused_launch.skinny_gemm(x_in, w)
                for sk in (int(v) for v in filter(None, args.package.split(","))):
                    variants[f"package split {sk} pdl"] = lambda sk=sk: fused_launch.skinny_gemm(x_in, w, split_k=sk)
            for c in filter(None, args.configs.split(",")):
                bn, bk, sk, st = (int(v) for v in c.split(":"))
                for pdl in (False, True):
                    g = Skinny(N, K, bn, bk, sk, st, pdl, dev)
                    variants[f"triton {c}{' pdl' if pdl else ''}"] = lambda g=g: g(x_in, w, y)
            floor_us = N * K * 2 / 4.26e12 * 1e6
            times = {name: [] for name in variants}
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            errs = {}
            for rep in range(args.repeats + 2):
                for name, fn in variants.items():
                    read(flush, sink, programs=4 * nsm)
                    a.record()
                    pdl = name.endswith("pdl")
                    _pre_kernel[(triton.cdiv(x.numel(), 1024),)](x, x_in, x.numel(), BLOCK=1024, PDL=pdl,
                                                                 **(dict(launch_pdl=True) if pdl else {}))
                    r = fn()
                    b.record()
                    torch.cuda.synchronize()
                    if rep < 2:  # warm-up rounds: check, do not time
                        errs[name] = ((r.float() - ref).abs().max() / ref.abs().max()).item()
                    else:
                        times[name].append(a.elapsed_time(b) * 1e3)
            for name, ts in times.items():
                med = statistics.median(ts)
                out.append(dict(shape=shape, rows=M, variant=name, us=med, floor_us=floor_us, rel_err=errs[name]))
                print(f"{shape} rows {M:2d} {name:28s} {med:7.2f} us  floor {floor_us:6.2f}  rel err {errs[name]:.1e}",
                      flush=True)
    write_json(args.json, "skinny_gemm_probe.py", out)

if __name__ == "__main__":
    main()
