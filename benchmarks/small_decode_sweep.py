"""Dense decode attention at SmolLM2-135M's shape (bs 1, 9 q / 3 KV heads, d 64, 8K context):
split count, tile length and fused merge, timed as the model runs it (30 layers, each with its own
cache, back to back in one CUDA graph). GPU only.

    python benchmarks/small_decode_sweep.py [--json out.json]

Prints, per variant, the median time of one layer's attention (graph replay time / 30).
"""

from __future__ import annotations

import argparse
import json

import torch

from doublesparse.bench.attention import time_fn
from doublesparse.kernels import ops
from doublesparse.kernels.triton import launch
from doublesparse.kernels.workspace import DecodeWorkspace

LAYERS, HQ, HKV, D = 30, 9, 3, 64


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--ctx", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    dev = torch.device("cuda")
    B, L = args.batch, args.ctx
    S = B * L + 1
    caches = [(torch.randn(S, HKV, D, device=dev, dtype=torch.bfloat16),
               torch.randn(S, HKV, D, device=dev, dtype=torch.bfloat16)) for _ in range(LAYERS)]
    q = torch.randn(B, HQ, D, device=dev, dtype=torch.bfloat16)
    rt = (1 + torch.arange(B * L, device=dev, dtype=torch.int32)).view(B, L)
    req_idx = torch.arange(B, device=dev, dtype=torch.int32)
    seq_lens = torch.full((B,), L, device=dev, dtype=torch.int32)
    ws = DecodeWorkspace(B, HQ, HKV, D, max_ctx=L, device=dev, max_splits=128)
    out = torch.empty_like(q)
    ref = ops.dense_decode(q, *caches[0], rt, req_idx, seq_lens, D ** -0.5, ws=ws, impl="torch")
    rows = []
    base = dict(launch.TUNING)
    for fuse in (False, True):
        for block_n in (64, 128, 256):
            for splits in (0, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128):
                launch.TUNING.update(base, fuse_merge=fuse, attn_block_n=block_n)
                ns = splits or None
                if splits and splits * block_n > 2 * L:
                    continue
                try:
                    o = launch.dense_decode(q, *caches[0], rt, req_idx, seq_lens, D ** -0.5, ws, out, num_splits=ns)
                    err = (o.float() - ref.float()).abs().max().item()

                    def step():
                        for k, v in caches:
                            launch.dense_decode(q, k, v, rt, req_idx, seq_lens, D ** -0.5, ws, out, num_splits=ns)
                    us = time_fn(step, reps=1, iters=50) * 1e6 / LAYERS
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"fuse={fuse} block_n={block_n} splits={splits}: FAILED {e}"[:300], flush=True)
                    continue
                eff = splits or launch.dense_splits(B, HKV, ws, dev)
                byts = 2 * B * L * HKV * D * 2
                rows.append(dict(fuse_merge=fuse, block_n=block_n, splits=eff, auto=not splits, us=us, err=err))
                print(f"fuse={int(fuse)} block_n={block_n:4d} splits={eff:4d}{' (auto)' if not splits else '       '} "
                      f"{us:6.2f} us/layer  {byts / us / 1e6:5.2f} TB/s  err {err:.1e}", flush=True)
    launch.TUNING.update(base)
    best = min(rows, key=lambda r: r["us"])
    print("best:", best)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(batch=B, ctx=L, layers=LAYERS, heads=[HQ, HKV, D], rows=rows, best=best), f, indent=1)


if __name__ == "__main__":
    main()
