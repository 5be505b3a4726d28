"""Where a long prompt's prefill time goes: wall time per chunk step and a per-kernel table.

    python benchmarks/profile_prefill.py [--model-path llama-3.1-8b] [--input-len 32768]
        [--chunked-prefill-size 16384] [--enable-double-sparsity] [--json OUT.json]

Dummy weights. One warm-up prompt (cuDNN builds its execution graphs per shape), then one prompt
of random ids with max_new_tokens=1, run under torch.profiler; kernels are grouped by name (the
argument list cut off) and by a coarse class (GEMM, attention, norm/elementwise, copy/index,
other). Also prints the prefill FLOPs (linear layers + causal attention) and the rate achieved.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict

import torch

from doublesparse import Engine

CLASSES = [("gemm", r"nvjet|gemm|cutlass|sm90_xmma|splitK"), ("attention", r"cudnn|flash|fmha|attention|sdpa"),
           ("copy/index", r"copy|index|gather|scatter|cat|elementwise_kernel<.*direct_copy"),
           ("norm/elementwise", r"rmsnorm|silu|rope|store|elementwise|reduce|softmax|exp|mul|add")]


def kernel_class(name: str) -> str:
    for c, pat in CLASSES:
        if re.search(pat, name, re.I):
            return c
    return "other"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default="llama-3.1-8b")
    ap.add_argument("--input-len", type=int, default=32768)
    ap.add_argument("--chunked-prefill-size", type=int, default=16384)
    ap.add_argument("--enable-double-sparsity", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    L = args.input_len
    eng = Engine(model_path=args.model_path, load_format="dummy", max_total_tokens=2 * L + 4096,
                 context_length=L + 1024, max_running_requests=2,
                 chunked_prefill_size=args.chunked_prefill_size,
                 enable_double_sparsity=args.enable_double_sparsity, progress=False)
    mc = eng.model_config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 10000, (L,), generator=g).tolist()
    sp = dict(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    eng.generate(ids[::-1], sp)  # warm-up at the same shapes
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.generate(ids, sp)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.generate(ids[1:] + ids[:1], sp)
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            nm = e.name.split("(")[0][:90]
            per[nm][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            per[nm][1] += 1
    total_us = sum(v[0] for v in per.values())
    by_class = defaultdict(float)
    for nm, (us, _) in per.items():
        by_class[kernel_class(nm)] += us
    # FLOPs: 2 per weight per token (no lm_head but the last token's), causal attention 2 x 2 x L^2/2 x Hq x D per layer
    H, n_layers = mc.hidden_size, mc.num_layers
    w_layer = sum(p.numel() for n, p in eng.parts.model.named_parameters()
                  if n.startswith("layers.0.") and p.dim() == 2)
    flops = 2 * w_layer * n_layers * L + 2 * 2 * (L * L / 2) * mc.num_q_heads * mc.head_dim * n_layers
    print(f"# {torch.cuda.get_device_name()}  prompt {L}, chunks of {args.chunked_prefill_size}, "
          f"DS {'on' if args.enable_double_sparsity else 'off'}")
    print(f"prefill wall {wall:.3f} s, kernel time {total_us / 1e6:.3f} s, {flops / 1e12:.0f} TFLOP "
          f"-> {flops / wall / 1e12:.0f} TFLOP/s (wall)")
    for c, us in sorted(by_class.items(), key=lambda x: -x[1]):
        print(f"  {c:<18} {us / 1e3:9.1f} ms  {us / total_us:5.1%}")
    rows = sorted(per.items(), key=lambda x: -x[1][0])
    for nm, (us, n) in rows[:25]:
        print(f"  {us / 1e3:9.1f} ms  {n:6d}  {nm}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command="python benchmarks/profile_prefill.py " + " ".join(sys.argv[1:]),
                           device=torch.cuda.get_device_name(), wall_s=wall, flops=flops,
                           by_class=by_class, kernels=[dict(name=nm, us=us, calls=n) for nm, (us, n) in rows]),
                      f, indent=1)


if __name__ == "__main__":
    main()
