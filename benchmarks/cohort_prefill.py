"""A cohort of long prompts prefilled through the engine, step by step, with the GPU's clocks.

    python benchmarks/cohort_prefill.py [--model-path llama-3.1-8b] [--input-len 32768]
        [--num-prompts 16] [--chunked-prefill-size 32768] [--enable-double-sparsity] [--json OUT]

Issue 5's servers took ~1.35 s per 32K prompt (a 16-request cohort's TTFT is 21.7 s), while
``benchmarks/profile_prefill.py`` measured 1.24 s for one prompt on an otherwise idle GPU. This
runs the server's engine configuration (pool for num_prompts x (prompt + 1024) tokens, that many
request rows, the cohort schedule, CUDA graphs) without HTTP, times every step (each one waits for
the GPU) and samples nvidia-smi's SM clock, power and temperature every 100 ms, to tell a clock drop
under sustained load from per-step engine overhead. Dummy weights; one warm-up prompt first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

import torch

from doublesparse import Engine


class SmiSampler:
    """nvidia-smi samples (host time, SM MHz, W, deg C) in a background thread."""

    QUERY = "clocks.sm,power.draw,temperature.gpu"

    def __init__(self, period_ms: int = 100):
        self.samples: list[tuple[float, float, float, float]] = []
        try:
            self._p = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                                        f"-lms={period_ms}"], stdout=subprocess.PIPE, text=True)
        except OSError:
            self._p = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self._p.stdout:
            try:
                mhz, watts, temp = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.perf_counter(), mhz, watts, temp))

    def between(self, t0: float, t1: float):
        s = [x for x in self.samples if t0 <= x[0] <= t1]
        if not s:
            return None
        return tuple(statistics.mean(x[i] for x in s) for i in (1, 2, 3))

    def stop(self):
        if self._p is not None:
            self._p.terminate()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default="llama-3.1-8b")
    ap.add_argument("--input-len", type=int, default=32768)
    ap.add_argument("--output-len", type=int, default=1024, help="only sizes the pool, as the server's")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--chunked-prefill-size", type=int, default=32768)
    ap.add_argument("--prefill-schedule", default="cohort")
    ap.add_argument("--enable-double-sparsity", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    L, N = args.input_len, args.num_prompts
    ctx = L + args.output_len
    eng = Engine(model_path=args.model_path, load_format="dummy", max_total_tokens=N * ctx,
                 context_length=ctx, max_running_requests=N, chunked_prefill_size=args.chunked_prefill_size,
                 prefill_schedule=args.prefill_schedule, enable_double_sparsity=args.enable_double_sparsity,
                 ds_heavy_channel_num=16 if args.enable_double_sparsity else None,
                 ds_heavy_token_num=L // 16 if args.enable_double_sparsity else None, progress=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 10000, (L,), generator=g).tolist() for _ in range(N + 1)]
    sp = dict(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    eng.generate([prompts[-1]], sp)  # warm-up (cuDNN builds its execution plans per shape)
    sync()
    smi = SmiSampler()
    time.sleep(1.0)
    idle = smi.between(0, time.perf_counter())
    for p in prompts[:N]:
        eng.add_request(p, sp)
    steps = []
    t_start = time.perf_counter()
    while eng.has_unfinished():
        before = eng.counters["prefill_tokens"]
        t0 = time.perf_counter()
        outs = eng.step()
        sync()
        t1 = time.perf_counter()
        steps.append(dict(wall_s=t1 - t0, prefill_tokens=eng.counters["prefill_tokens"] - before,
                          outputs=len(outs), smi=smi.between(t0, t1)))
    total = time.perf_counter() - t_start
    time.sleep(0.3)
    smi.stop()
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"# {name}: {N} prompts of {L}, chunks {args.chunked_prefill_size}, schedule {args.prefill_schedule}, "
          f"DS {'on' if args.enable_double_sparsity else 'off'}")
    print(f"idle before: SM MHz / W / C = {idle}")
    print("step  wall_s  prefill_tok  outputs  SM_MHz  W  C")
    for i, s in enumerate(steps):
        m = s["smi"] or (float("nan"),) * 3
        print(f"{i:4d}  {s['wall_s']:.4f}  {s['prefill_tokens']:6d}  {s['outputs']:3d}  {m[0]:.0f}  {m[1]:.0f}  {m[2]:.0f}")
    pre = [s["wall_s"] for s in steps if s["prefill_tokens"]]
    print(f"total {total:.3f} s for {N} prompts: {total / N:.4f} s per prompt; prefill steps: median "
          f"{statistics.median(pre):.4f} s, first {pre[0]:.4f}, last {pre[-1]:.4f}")
    if args.json:
        json.dump(dict(command=" ".join(sys.argv), device=name, total_s=total, per_prompt_s=total / N,
                       idle_smi=idle, steps=steps), open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
