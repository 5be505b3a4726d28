"""Probe: does the K/V pool's layout change how fast the selected rows are gathered? One layer,
Llama-3.1-8B shapes (8 KV heads, d 128, bf16), r 16, k = L / 16, group_max.

    python benchmarks/kv_layout_probe.py [--cases 3x65536,3x131072,16x32768] [--rounds 2] [--json OUT.json]

Layouts: "split", K and V pools apart ([slots, Hkv, D] each, as the engine allocates them);
"interleaved", one [slots, Hkv, 2, D] tensor whose K and V halves are passed as strided views, so
a selected (token, head) is 512 contiguous bytes instead of two 256-byte rows in different pools;
and "headmajor", K and V pools stored [Hkv, slots, D] and passed as [slots, Hkv, D] views, so that
one head's rows of nearby tokens are near each other in memory (a selected row's neighbours in
the gather are 16 tokens apart on average at k = L / 16: 4 KB in head-major order, 32 KB in
slot-major).
Per layout: the attention stage alone (stage "attend", on the selection of a whole call made first,
one graph call on the same copy: partly L2-warm), the whole DS call and the dense decode (CUDA graph
over rotating pool copies, as bench.attention times them); medians of replays. Session 17 ran it
(commit 175f35a) also with a CUDA attention kernel since removed (results/h200-s17/README.md).
"""

from __future__ import annotations

import argparse
import math

import torch

from doublesparse.bench.attention import HKV, HQ, D, MIN_BYTES_PER_GRAPH, Pools, copy_bandwidth, time_fn
from doublesparse.kernels.triton import launch
from doublesparse.kernels.workspace import DecodeWorkspace
from probe_lib import write_json


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="3x65536,3x131072,16x32768")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"# {torch.cuda.get_device_name(dev)} copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for case in args.cases.split(","):
        B, L = (int(x) for x in case.split("x"))
        k = L // 16
        copies = max(1, math.ceil(MIN_BYTES_PER_GRAPH / (B * L * HKV * D * 4)))
        p = Pools(B, L, copies, 16, torch.bfloat16, dev)
        kv = torch.stack([p.k, p.v], dim=2)  # [slots, Hkv, 2, D]
        hm = [t.permute(1, 0, 2).contiguous().permute(1, 0, 2) for t in (p.k, p.v)]
        layouts = {"split": (p.k, p.v), "interleaved": (kv[:, :, 0], kv[:, :, 1]), "headmajor": tuple(hm)}
        ws = DecodeWorkspace(B, HQ, HKV, D, L, k, device=dev)
        sm = 1 / math.sqrt(D)
        sel_bytes = B * HKV * k * D * 4
        print(f"bs{B} L={L} k={k}: selected K/V {sel_bytes / 1e6:.1f} MB, floor {sel_bytes / bw * 1e6:.1f} us", flush=True)
        res = {}
        for rnd in range(args.rounds):
            for name, (kc, vc) in layouts.items():
                def ds(i=0, stage="all"):
                    launch.ds_decode(p.q, kc, vc, p.labels, p.scale, p.channels, p.req_to_token, p.req_idx[i],
                                     p.seq_lens, sm, k, "group_max", ws=ws, out=p.out, stage=stage)
                ds(0)  # the selection the attend stage reads
                tag = name + (f" r{rnd}" if rnd else "")
                res[f"attend {tag}"] = time_fn(lambda i=0: ds(0, "attend"), 1) * 1e6
                res[f"all {tag}"] = time_fn(ds, copies) * 1e6
                res[f"dense {tag}"] = time_fn(lambda i=0: launch.dense_decode(
                    p.q, kc, vc, p.req_to_token, p.req_idx[i], p.seq_lens, sm, ws, out=p.out), copies) * 1e6
        for n, us in res.items():
            frac = f"  sel bw {sel_bytes / (us / 1e6) / bw:.2f}" if n.startswith("attend") else ""
            print(f"  {n:30s} {us:7.1f} us{frac}", flush=True)
        rows.append(dict(batch=B, ctx=L, k=k, sel_bytes=sel_bytes, copy_bw=bw, us=res))
        del p, kv, hm, layouts
        torch.cuda.empty_cache()
    write_json(args.json, "kv_layout_probe.py", rows)


if __name__ == "__main__":
    main()
