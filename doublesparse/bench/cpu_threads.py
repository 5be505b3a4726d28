"""``python -m doublesparse.bench.cpu_threads``: the CPU thread choice (engine/cpu_threads.py)
against fixed thread counts, on the cores as they are and with competing CPU-burning processes.

For each load ("as is": nothing started; "burners": ``--burners`` processes spinning a Python
loop, as another program holding cores would) and each mode:

* ``auto``: the default (the cores other processes leave free; small decode batches also timed),
* ``timing-only``: what the engine did before (prefill on all threads, decode by timing alone),
* ``1``: ``--cpu-threads 1``,
* ``all``: ``--cpu-threads`` = torch's thread count,

it measures a short prompt's prefill (time to the first token of a request with
``max_new_tokens=1``), a long prompt's prefill, and one request's greedy decode (seconds per
token from the engine's own step times). Modes take turns within each of ``--reps`` rounds so that
drift in the machine's background load hits all of them alike; the medians are reported, with
auto's ratio to the best fixed choice, and the load other processes put on the cores before each
condition (``others_cores``, from ``/proc/stat``). Engine flags (``--model-path`` etc.) pass
through; the prefix cache is off so every prefill computes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

MODES = ("auto", "timing-only", "1", "all")


class _AllCores:
    """A CoreLoad that always reports every core free: the policy before load detection."""

    def free_cores(self, max_threads: int) -> int:
        return max_threads


def policy(mode: str):
    from ..engine.cpu_threads import CpuThreads

    if mode == "auto":
        return CpuThreads()
    if mode == "timing-only":
        return CpuThreads(load=_AllCores())
    return CpuThreads(fixed=torch.get_num_threads() if mode == "all" else int(mode))


def others_cores(seconds: float = 1.0) -> float | None:
    """Cores' worth of CPU that other processes used over the next ``seconds``."""
    from ..engine.cpu_threads import CoreLoad

    load = CoreLoad()
    time.sleep(seconds)
    load.free_cores(os.cpu_count() or 1)
    return round(load.others, 2) if load.measured else None


def prompt_ids(tok, n: int, salt: int) -> list[int]:
    from ..assets import read_play

    ids = tok.encode(f"[{salt}] " + read_play("hamlet_gut")[salt * 97:salt * 97 + 40 * n],
                     add_special_tokens=False)
    return ids[:n]


def measure(engine, pol, args, salt: int) -> dict:
    engine.parts.runner.cpu_threads = pol
    tok = engine.tokenizer
    out = {}
    for key, n in (("short_prefill_s", args.short_prompt_tokens),
                   ("long_prefill_s", args.long_prompt_tokens)):
        ids = prompt_ids(tok, n, salt)
        t0 = time.perf_counter()
        engine.generate([ids], {"max_new_tokens": 1, "temperature": 0})
        out[key] = time.perf_counter() - t0
    before = engine.stats()
    engine.generate([prompt_ids(tok, args.short_prompt_tokens, salt + 1)],
                    {"max_new_tokens": args.decode_tokens + 1, "temperature": 0, "ignore_eos": True})
    after = engine.stats()
    n = after["decode_tokens"] - before["decode_tokens"]
    out["decode_s_per_token"] = (after["decode_time"] - before["decode_time"]) / max(1, n)
    return out


def run_condition(engine, args, burners: int, salt0: int) -> dict:
    """Each mode's policy lives through the whole condition, as in a running server."""
    policies = {m: policy(m) for m in args.modes}
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    try:
        time.sleep(0.5 if procs else 0.0)
        res = {"burners": burners, "others_cores_before": others_cores(),
               "loadavg_before": os.getloadavg()[0], "runs": {m: [] for m in args.modes}}
        for r in range(args.reps):
            for k, m in enumerate(args.modes):
                res["runs"][m].append(measure(engine, policies[m], args, salt0 + 10 * r + k))
                print(f"burners={burners} rep={r} {m}: "
                      + ", ".join(f"{x}={v:.4f}" for x, v in res["runs"][m][-1].items()),
                      file=sys.stderr, flush=True)
        res["loadavg_after"] = os.getloadavg()[0]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    res["median"] = {m: {x: statistics.median(run[x] for run in runs) for x in runs[0]}
                     for m, runs in res["runs"].items()}
    fixed = [m for m in ("1", "all") if m in res["median"]]
    if "auto" in res["median"] and fixed:
        res["auto_over_best_fixed"] = {
            x: round(res["median"]["auto"][x] / min(res["median"][m][x] for m in fixed), 3)
            for x in res["median"]["auto"]}
    return res


def machine() -> str:
    model = ""
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                     if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{platform.system()} {platform.machine()}, {cpus} CPUs {model}".strip()


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def build_parser() -> argparse.ArgumentParser:
    from ..config_flags import add_cli_args

    p = argparse.ArgumentParser(prog="python -m doublesparse.bench.cpu_threads",
                                description=__doc__.splitlines()[0])
    p.add_argument("--burners", type=int, nargs="+", default=[0, 1],
                   help="competing processes per condition (0: the cores as they are)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--short-prompt-tokens", type=int, default=16)
    p.add_argument("--long-prompt-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--result-json", default=None)
    add_cli_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..config_flags import from_cli_args
    from ..api import Engine

    cfg = from_cli_args(args, device="cpu", disable_radix_cache=True, max_total_tokens=8192,
                        context_length=2048)
    engine = Engine(cfg, progress=False)
    measure(engine, policy("1"), args, salt=0)   # warm-up: first-call costs out of every mode's numbers
    res = {"command": "python -m doublesparse.bench.cpu_threads " + " ".join(
               argv if argv is not None else sys.argv[1:]),
           "commit": commit(), "machine": machine(), "torch_threads": torch.get_num_threads(),
           "torch": torch.__version__,
           "date": datetime.date.today().isoformat(),
           "prompt_tokens": {"short": args.short_prompt_tokens, "long": args.long_prompt_tokens},
           "decode_tokens": args.decode_tokens,
           "conditions": {}}
    for i, b in enumerate(args.burners):
        res["conditions"][f"burners={b}"] = run_condition(engine, args, b, salt0=100 * (i + 1))
    print(json.dumps(res, indent=1))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
