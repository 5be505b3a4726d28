"""A/B of the split-prefix prefill call (attention/prefill.py) for one layer, on CUDA.

    python benchmarks/prefill_split_ab.py [--cases 16384x16384,4096x28672] [--json OUT.json]

Case ``NxP``: a chunk of N query tokens after P cached tokens, Llama-3.1-8B heads (32 query / 8 KV,
d 128, bf16), K/V handed over as the engine does (a gathered [L, Hkv, D] tensor, transposed).
"before": session 10's path, which repeated the whole K/V (prefix included) over the query group
and then copied each half contiguous; "after": ``prefill._split_prefix`` as committed, where the
chunk-vs-prefix call folds the group into the query rows and only the chunk's own K/V is repeated.
Times are medians of CUDA-event timings; outputs are compared first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from doublesparse.attention import prefill
from doublesparse.bench.profile_step import gpu_times
from doublesparse.kernels.triton.fused_launch import lse_merge


def before(q, k, v, prefix_len, scale):
    g = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    o1, lse1 = prefill._attention_lse(q, k[:, :prefix_len], v[:, :prefix_len], False, scale)
    o2, lse2 = prefill._attention_lse(q, k[:, prefix_len:], v[:, prefix_len:], True, scale)
    return lse_merge(o1, o2, lse1[..., 0].contiguous(), lse2[..., 0].contiguous())


def time_ms(fn, reps=10):
    for _ in range(2):
        fn()
    return statistics.median(gpu_times(fn, reps)) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="16384x16384,4096x28672,4096x4096")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev, dt, Hq, Hkv, D = torch.device("cuda"), torch.bfloat16, 32, 8, 128
    rows = []
    for case in args.cases.split(","):
        n, p = (int(x) for x in case.split("x"))
        g = torch.Generator(device=dev).manual_seed(n + p)
        q = torch.randn(n, Hq, D, device=dev, dtype=dt, generator=g).transpose(0, 1)   # [Hq, n, D] view
        kv = torch.randn(2, p + n, Hkv, D, device=dev, dtype=dt, generator=g)
        k, v = kv[0].transpose(0, 1), kv[1].transpose(0, 1)                              # [Hkv, L, D] views
        scale = D ** -0.5
        ref = before(q, k, v, p, scale).float()
        got = prefill._split_prefix(q, k, v, p, scale).float()
        err = (got - ref).abs().max().item()
        t_b = time_ms(lambda: before(q, k, v, p, scale))
        t_a = time_ms(lambda: prefill._split_prefix(q, k, v, p, scale))
        rows.append(dict(chunk=n, prefix=p, before_ms=t_b, after_ms=t_a, max_abs_diff=err))
        print(f"chunk {n} after {p}: before {t_b:.3f} ms, after {t_a:.3f} ms (x{t_b / t_a:.2f}), "
              f"max|diff| {err:.2e}", flush=True)
        del q, kv, k, v
        torch.cuda.empty_cache()
    if args.json:
        json.dump(dict(command="python benchmarks/prefill_split_ab.py " + " ".join(sys.argv[1:]),
                       device=torch.cuda.get_device_name(), rows=rows), open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
