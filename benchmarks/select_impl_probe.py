"""Probe: two implementations of a DS stage, one layer's DS decode at given shapes. By default the
select's (TUNING["select_impl"]: Triton ds_topk.py, CUDA kernels/cuda/select.cu); ``--knob
score_impl --values mma,cuda`` compares the score's (ds_score.py, kernels/cuda/score.cu).

    python benchmarks/select_impl_probe.py [--cases 16x32768,3x65536] [--knob K --values A,B] [--json OUT.json]

Per case: whether the selections (sel, sel_slot) of the two are equal, element for element (same
positions in the same order: the selects must agree; two score kernels may round a score
differently and so pick a tied position differently); then each runs the whole DS call eagerly
under the PyTorch profiler, and the table gives each kernel's mean GPU time per call. Whole-call times in CUDA graphs, with batch
parts: benchmarks/ds_streams.py --tunings '[{}, {"select_impl": "cuda"}]'.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

import torch

from doublesparse.bench.attention import HKV, D
from doublesparse.kernels.triton import launch
from probe_lib import layer_cases, write_json


def run(p, ws, k, knob, impl, iters=0):
    launch.TUNING[knob] = impl
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
    ap.add_argument("--knob", default="select_impl", help="the launch.TUNING key to vary")
    ap.add_argument("--values", default="triton,cuda", help="its two values, comma-separated")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    knob = args.knob
    impls = [v if v.isalpha() and v not in ("true", "false") else json.loads(v) for v in args.values.split(",")]
    default_impl = launch.TUNING[knob]
    rows = []
    for B, L, k, p, ws in layer_cases(args.cases, dev):
        sels = {}
        for impl in impls:
            ws.sel.fill_(-7)
            ws.sel_slot.fill_(-7)
            run(p, ws, k, knob, impl)
            torch.cuda.synchronize()
            sels[impl] = (ws.sel[:B, :HKV, :k].clone(), ws.sel_slot[:B, :HKV, :k].clone())
        same = all(torch.equal(a, b) for a, b in zip(sels[impls[0]], sels[impls[-1]]))
        print(f"bs{B} L={L} k={k}: selections equal: {same}", flush=True)
        for impl in impls:
            us = run(p, ws, k, knob, impl, args.iters)
            total = sum(us.values())
            print(f"  {str(impl):6s} total {total:7.1f} us: " + ", ".join(
                f"{n[:28]} {t:.1f}" for n, t in sorted(us.items(), key=lambda x: -x[1])), flush=True)
            rows.append(dict(batch=B, ctx=L, k=k, knob=knob, impl=impl, selections_equal=same, kernel_us=us,
                             total_us=total))
    launch.TUNING[knob] = default_impl
    write_json(args.json, "select_impl_probe.py", rows)


if __name__ == "__main__":
    main()
