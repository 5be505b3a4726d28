"""Prefill attention on the GPU at Llama-3.1-8B's shape (32 q / 8 KV heads, d 128, bf16): which
torch SDPA backend, with K/V repeated over the group or GQA-native, for a whole prompt (causal) and
for a chunk after a cached prefix (lower-right causal); the engine's own call
(attention/prefill.prefill_sdpa) with and without SPLIT_PREFIX; what the engine's gather of the
prefix from the pool costs. Also one layer's GEMMs at the chunk's token count. GPU only.

    python benchmarks/prefill_attn_sweep.py [--json out.json]

TFLOPS counts the causal half only (2 matmuls x 2 FLOP per multiply-add over the unmasked part).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from doublesparse.attention import prefill
from doublesparse.bench.profile_step import gpu_times

HQ, HKV, D = 32, 8, 128
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def bench(fn, reps=10) -> tuple[float, float]:
    """(median seconds of warm calls, seconds of the first call): cuDNN builds an execution graph
    for each new shape in the first."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    return statistics.median(gpu_times(fn, reps)), first


def attn_flops(n, L):
    # unmasked (query, key) pairs of a lower-right causal n x L block
    pairs = n * (L - n) + n * (n + 1) / 2
    return 4 * HQ * D * pairs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []

    def rec(**kw):
        rows.append(kw)
        print(json.dumps(kw), flush=True)

    for n, L in ((4096, 4096), (8192, 8192), (32768, 32768), (4096, 32768), (8192, 32768), (4096, 61440)):
        q = torch.randn(1, HQ, n, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, HKV, L, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kr, vr = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
        mask = None if n == L else causal_lower_right(n, L)
        for name, be in BACKENDS.items():
            for gqa in (False, True):
                kk, vv = (k, v) if gqa else (kr, vr)

                def fn():
                    with sdpa_kernel([be]):
                        if mask is None:
                            return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
                        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=gqa)
                try:
                    t, first = bench(fn)
                    rec(kind="sdpa", n=n, L=L, backend=name, gqa=gqa, ms=t * 1e3,
                        tflops=attn_flops(n, L) / t / 1e12, first_call_ms=first * 1e3)
                except Exception as e:  # noqa: BLE001
                    rec(kind="sdpa", n=n, L=L, backend=name, gqa=gqa, error=str(e).split("\n")[0][:160])
        # the engine's own call (attention/prefill.py), and its split-prefix variant
        outs = []
        for split in (False, True):
            prefill.SPLIT_PREFIX = split
            try:
                fn = lambda: prefill.prefill_sdpa(q[0], k[0], v[0], L - n, D ** -0.5, mask)  # noqa: E731
                t, first = bench(fn)
                outs.append((split, fn().float()))
                ref = [o for sp, o in outs if not sp]
                diff = (outs[-1][1] - ref[0]).abs().max().item() if ref else None
                rec(kind="engine", n=n, L=L, split_prefix=split, ms=t * 1e3, tflops=attn_flops(n, L) / t / 1e12,
                    first_call_ms=first * 1e3, max_abs_diff_vs_unsplit=diff)
            except Exception as e:  # noqa: BLE001
                rec(kind="engine", n=n, L=L, split_prefix=split, error=str(e).split("\n")[0][:160])
        prefill.SPLIT_PREFIX = False
        # what the engine does before SDPA for a chunk with a prefix: gather + repeat over the group
        if n != L:
            pool = torch.randn(L + 1000, HKV, D, device=dev, dtype=torch.bfloat16)
            slots = torch.randperm(L + 1000, device=dev)[:L]

            def gather():
                ks = pool[slots].transpose(0, 1)
                return ks.repeat_interleave(HQ // HKV, 0)
            t, _ = bench(gather)
            rec(kind="gather_repeat_k", n=n, L=L, ms=t * 1e3)
        del q, k, v, kr, vr
        torch.cuda.empty_cache()
    # one Llama-3.1-8B layer's GEMMs at a chunk's token count
    for T in (4096, 8192):
        x = torch.randn(T, 4096, device=dev, dtype=torch.bfloat16)
        for name, (o, i) in {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                             "down": (4096, 14336)}.items():
            w = torch.randn(o, i, device=dev, dtype=torch.bfloat16)
            xi = x if i == 4096 else torch.randn(T, i, device=dev, dtype=torch.bfloat16)
            t, _ = bench(lambda: F.linear(xi, w))
            rec(kind="gemm", T=T, name=name, ms=t * 1e3, tflops=2 * T * o * i / t / 1e12)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
