"""Probe: the select's two implementations (TUNING["select_impl"]: Triton ds_topk.py, CUDA
kernels/cuda/select.cu), one layer's DS decode at given shapes.

    python benchmarks/select_impl_probe.py [--cases 16x32768,3x65536] [--json OUT.json]

Per case: the selection (sel, sel_slot) of both must be equal, element for element (same positions
in the same order); then each runs the whole DS call eagerly under the PyTorch profiler, and the
table gives each kernel's mean GPU time per call. Whole-call times in CUDA graphs, with batch
parts: benchmarks/ds_streams.py --tunings '[{}, {"select_impl": "cuda"}]'.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict

import torch

from doublesparse.bench.attention import HKV, HQ, D, Pools
from doublesparse.kernels.triton import launch
from doublesparse.kernels.workspace import DecodeWorkspace
from probe_lib import write_json

IMPLS = ("triton", "cuda")


def run(p, ws, k, impl, iters=0):
    launch.TUNING["select_impl"] = impl
    sm = 1 / math.sqrt(D)
    call = lambda: launch.ds_decode(p.q, p.k, p.v, p.labels, p.scale, p.channels, p.req_to_token,  # noqa: E731
                                    p.req_idx[0], p.seq_lens, sm, k, "group_max", ws=ws, out=p.out)
    call()
    if not iters:
        return None
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    us = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us[e.name] += e.device_time / iters
    return dict(us)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="16x32768,3x65536,3x131072")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    default_impl = launch.TUNING["select_impl"]
    rows = []
    for case in args.cases.split(","):
        B, L = (int(x) for x in case.split("x"))
        k = L // 16
        p = Pools(B, L, 1, 16, torch.bfloat16, dev)
        ws = DecodeWorkspace(B, HQ, HKV, D, L, k, device=dev)
        sels = {}
        for impl in IMPLS:
            ws.sel.fill_(-7)
            ws.sel_slot.fill_(-7)
            run(p, ws, k, impl)
            torch.cuda.synchronize()
            sels[impl] = (ws.sel[:B, :HKV, :k].clone(), ws.sel_slot[:B, :HKV, :k].clone())
        same = all(torch.equal(a, b) for a, b in zip(sels["triton"], sels["cuda"]))
        print(f"bs{B} L={L} k={k}: selections equal: {same}", flush=True)
        for impl in IMPLS:
            us = run(p, ws, k, impl, args.iters)
            total = sum(us.values())
            print(f"  {impl:6s} total {total:7.1f} us: " + ", ".join(
                f"{n[:28]} {t:.1f}" for n, t in sorted(us.items(), key=lambda x: -x[1])), flush=True)
            rows.append(dict(batch=B, ctx=L, k=k, impl=impl, selections_equal=same, kernel_us=us,
                             total_us=total))
        del p, ws
        torch.cuda.empty_cache()
    launch.TUNING["select_impl"] = default_impl
    write_json(args.json, "select_impl_probe.py", rows)


if __name__ == "__main__":
    main()
