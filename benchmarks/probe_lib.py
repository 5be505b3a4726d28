"""Shared by the GPU probes in benchmarks/ (l2_prefetch_probe.py, skinny_gemm_probe.py,
select_impl_probe.py, score_cuda_probe.py): a streaming read of a tensor with a chosen L2 eviction
policy (to flush L2, or to load a tensor into it), the one-layer DS cases of the select and score
probes, and the result file every probe writes (its command, date, device and rows)."""

from __future__ import annotations

import json
import sys
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _read_kernel(src, sink, n, BLOCK: tl.constexpr, POLICY: tl.constexpr):
    # Reads src[0:n] (bf16) once; the sum goes to sink only if it is NaN, which keeps the loads.
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < n, other=0.0, eviction_policy=POLICY).to(tl.float32)
    s = tl.sum(acc, 0)
    tl.store(sink + pid, s, mask=s != s)


def read(t: torch.Tensor, sink: torch.Tensor, policy: str = "", programs: int = 528):
    """Read ``t`` (bf16) once on the current stream; policy "", "evict_first" or "evict_last".
    sink: float32, at least ``programs`` entries. 528 programs = 4 per SM of an H200."""
    _read_kernel[(programs,)](t, sink, t.numel(), BLOCK=4096, POLICY=policy, num_warps=8)


def layer_cases(spec: str, dev, copies: int = 1):
    """The probes' one-layer DS cases: for each "BxL" of ``spec`` (comma-separated; "BxLfp8" for fp8
    labels), Llama-3.1-8B layer pools with bf16 labels of r 16 and a workspace for k = L / 16;
    yields (B, L, k, pools, ws). ``copies``: independent batches in the pools (``pools.req_idx[i]``),
    so that a timing loop can rotate over more labels than L2 holds."""
    from doublesparse.bench.attention import FP8, HKV, HQ, D, Pools
    from doublesparse.kernels.workspace import DecodeWorkspace
    for case in spec.split(","):
        fp8 = case.endswith("fp8")
        B, L = (int(x) for x in case.removesuffix("fp8").split("x"))
        k = L // 16
        pools = Pools(B, L, copies, 16, FP8 if fp8 else torch.bfloat16, dev)
        yield B, L, k, pools, DecodeWorkspace(B, HQ, HKV, D, L, k, device=dev)


def write_json(path: str | None, script: str, rows: list) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(dict(command=f"python benchmarks/{script} " + " ".join(sys.argv[1:]),
                           date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), rows=rows), f,
                      indent=1)
