"""Where one decode step's time goes: GPU-only step time and a per-kernel table.

Used by ``bench_one_batch --profile``. The step is run once through the runner (which assigns the
new token's slot), then repeated on the same inputs: replaying the captured CUDA graph when there
is one (so the time excludes all host work), else the eager forward. Repeating a step rewrites the
same slot with the same K/V, so the cache is unchanged.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict

import torch


def _step_fn(parts, rows, tokens, positions):
    runner, mem = parts.runner, parts.memory
    runner.decode(rows, tokens, positions)
    B = len(rows)
    ks, sparse = parts.backend.decode_plan([p + 1 for p in positions])
    bucket = next((b for b, sp in runner.graphs if b >= B and sp == sparse), None)
    if bucket is not None:
        return runner.graphs[(bucket, sparse)][0].replay, f"graph bs{bucket}{' sparse' if sparse else ''}"
    row_t = torch.tensor(rows, dtype=torch.int64)
    pos_t = torch.tensor(positions, dtype=torch.int64)
    slots = mem.req_to_token_host[row_t, pos_t].to(torch.int64)  # assigned by the decode above
    host = runner.host_inputs(tokens, pos_t, slots, row_t)
    k = None if ks is None else torch.tensor(ks, dtype=torch.int32, device=parts.device)

    def eager():
        with torch.inference_mode():
            runner._decode_eager(B, host, None, k, sparse)
    return eager, "eager"


def gpu_times(fn, iters: int) -> list[float]:
    """Seconds of each of ``iters`` calls of fn, by CUDA events (fn is not synchronized inside)."""
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def profile_decode(parts, rows, tokens, positions, json_path: str | None = None, iters: int = 20,
                   top: int = 25) -> dict:
    """Print and return {'mode', 'gpu_step_median_s', 'kernels': [{name, us_per_step, calls_per_step}]}."""
    if parts.device.type != "cuda":
        print("profile: CUDA only, skipped")
        return {}
    fn, mode = _step_fn(parts, rows, tokens, positions)
    fn()
    torch.cuda.synchronize()
    med = statistics.median(gpu_times(fn, iters))
    print(f"Profile. decode step GPU time ({mode}, no host work): median {med * 1e3:.3f} ms over {iters}")
    from torch.profiler import ProfilerActivity, profile
    n = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    agg = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[ev.name]
            a[0] += ev.device_time
            a[1] += 1
    rows_out = sorted(({"name": k, "us_per_step": v[0] / n, "calls_per_step": v[1] / n} for k, v in agg.items()),
                      key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows_out)
    print(f"Profile. kernels per step: {sum(r['calls_per_step'] for r in rows_out):.0f} launches, "
          f"{total / 1e3:.3f} ms of kernel time")
    for r in rows_out[:top]:
        print(f"  {r['us_per_step']:9.1f} us  {r['calls_per_step']:5.0f}x  {r['name'][:110]}")
    res = {"mode": mode, "gpu_step_median_s": med, "kernel_us_per_step": total, "kernels": rows_out}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    return res
