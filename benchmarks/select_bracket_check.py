"""How often the sample select's bracket holds (ds_sample.py), on the benchmark's random pools.

Runs one DS decode of one layer per case with launch.TUNING["select_impl"] = "sample" and reads
the workspace's row info: a row whose bracket missed was redone by one program over the whole row
(exact, slow). Prints, per case, rows held / rows, and the candidate counts.
Usage: python benchmarks/select_bracket_check.py [BxL ...] (GPU)
"""

import math
import sys

import torch

from doublesparse.bench.attention import HKV, HQ, D, Pools
from doublesparse.kernels.triton import launch
from doublesparse.kernels.workspace import DecodeWorkspace


def main(cases):
    launch.TUNING["select_impl"] = "sample"
    dev = torch.device("cuda")
    for case in cases:
        B, L = map(int, case.split("x"))
        k = L // 16
        for seed in range(3):
            p = Pools(B, L, 1, 16, torch.bfloat16, dev, seed=seed)
            ws = DecodeWorkspace(B, HQ, HKV, D, L, k, device=dev)
            launch.ds_decode(p.q, p.k, p.v, p.labels, p.scale, p.channels, p.req_to_token,
                             p.req_idx[0], p.seq_lens, 1 / math.sqrt(D), k, "group_max", ws=ws, out=p.out)
            lo, hi, c_gt, c_in = ws.rowinfo[:B, :HKV].cpu().unbind(-1)
            held = (c_gt < k) & (c_gt + c_in >= k) & ((c_in <= k) | (lo == hi))
            print(f"bracket {case} seed {seed}: held {int(held.sum())}/{held.numel()}, candidates "
                  f"median {int(c_in.median())} max {int(c_in.max())} (cap {k}), above hi median "
                  f"{int(c_gt.median())} of k={k}", flush=True)
            del p, ws
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["3x65536", "16x32768"])
