"""Drive the decode kernels for a profiler (ncu) at one shape, eagerly, a few times each.

    ncu --clock-control none -k regex:'score|hist|compact|select|decode_attn|merge' --launch-skip 5 \
        --launch-count 5 --set full python benchmarks/profile_kernels.py [--batch 3 --ctx 65536] [--fp8]

``--dump DIR`` also writes the compiled score/select kernels (TTGIR, PTX, cubin) there.
"""

from __future__ import annotations

import argparse
import math
import os

import torch

from doublesparse.bench.attention import HKV, HQ, D, Pools
from doublesparse.kernels.triton import ds_launch, launch
from doublesparse.kernels.tuning import DEFAULT_TUNING, KernelTuning
from doublesparse.kernels.workspace import DecodeWorkspace


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=65536)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--k", type=int, default=None)
    ap.add_argument("--mode", default="group_max")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--dump", default=None)
    ap.add_argument("--tuning", default=None, help="JSON dict of KernelTuning overrides")
    ap.add_argument("--fp8", action="store_true", help="fp8 (e4m3) labels instead of bf16")
    args = ap.parse_args()
    tuning = DEFAULT_TUNING
    if args.tuning:
        import json
        tuning = KernelTuning.from_dict(json.loads(args.tuning))
    dev = torch.device("cuda")
    B, L = args.batch, args.ctx
    k = args.k or L // 16
    from doublesparse.bench.attention import FP8
    p = Pools(B, L, 1, args.r, FP8 if args.fp8 else torch.bfloat16, dev)
    ws = DecodeWorkspace(B, HQ, HKV, D, L, k, device=dev)
    sm = 1 / math.sqrt(D)
    ks = torch.full_like(p.seq_lens, k)  # one budget for the whole batch
    for _ in range(args.iters):
        ds_launch.ds_decode(p.q, p.k, p.v, p.labels, p.scale, p.channels, p.req_to_token, p.req_idx[0],
                            p.seq_lens, sm, ks, k, args.mode, ws=ws, out=p.out, tuning=tuning)
    for _ in range(args.iters):
        launch.dense_decode(p.q, p.k, p.v, p.req_to_token, p.req_idx[0], p.seq_lens, sm, ws, out=p.out,
                            tuning=tuning)
    torch.cuda.synchronize()
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        from doublesparse.kernels.triton import decode_attn, ds_score, ds_score_rows, ds_select
        for fn in (ds_score.score_mma_kernel, ds_score_rows.score_kernel, ds_select.select_kernel,
                   decode_attn.decode_attn_kernel):
            for dev_cache in fn.device_caches.values():
                for i, kern in enumerate(dev_cache[0].values()):
                    name = getattr(kern, "name", fn.fn.__name__)  # the phase's name for select_kernel
                    for ext in ("ttgir", "ptx", "cubin"):
                        if ext in kern.asm:
                            mode = "wb" if ext == "cubin" else "w"
                            with open(os.path.join(args.dump, f"{name}.{i}.{ext}"), mode) as f:
                                f.write(kern.asm[ext])
                    md = kern.metadata
                    print(name, i, "regs", getattr(kern, "n_regs", "?"), "spills",
                          getattr(kern, "n_spills", "?"), "shared", getattr(md, "shared", "?"))
    print("done")


if __name__ == "__main__":
    main()
