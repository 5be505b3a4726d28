"""``python -m doublesparse.bench.heap``: does the engine keep host memory per request?

Drives the engine in-process (no HTTP) through rounds of the mix a server sees: prompts that share a
prefix (prefix-cache hits), requests aborted after their first tokens (client disconnects), requests
asking for logprobs and prompt logprobs, and plain ones. After each round it collects garbage and
samples glibc's heap (bytes in use, free-but-kept, mmapped), the RSS, the bytes Python's tracemalloc
traces, and the size of every list / dict / set / deque the engine and its parts hold. The first
round (compiles, graph capture, first allocations) is the baseline; growth is fitted over the rest
and reported per request, with the containers that grew and, with ``--tracemalloc``, the source
lines whose traced bytes grew most. A heap that grows while tracemalloc's bytes stay flat is held
by native code (torch, the CUDA driver, Triton's launcher); a container that grows names the
bookkeeping that forgets to drop a request.

    python -m doublesparse.bench.heap --model-path llama-3.1-8b --load-format dummy --rounds 8
    python -m doublesparse.bench.heap --engine-factory doublesparse.server.fake_engine:tiny_engine \\
        --engine-kwargs '{"vocab_size": 128256, "max_position_embeddings": 8192}' --prompt-len 500
"""

from __future__ import annotations

import collections
import gc
import json
import os
import random
import resource
import time
import tracemalloc

from ..cli_common import Parser, run_main
from ..config_flags import add_cli_args

CONTAINERS = (list, dict, set, collections.deque)


def build_parser() -> Parser:
    p = Parser(prog="python -m doublesparse.bench.heap", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="rounds after the baseline round")
    p.add_argument("--requests", type=int, default=48, help="requests a round")
    p.add_argument("--prompt-len", type=int, default=2000, help="longest prompt, in tokens (random ids)")
    p.add_argument("--fixed-len", action="store_true",
                   help="every prompt --prompt-len tokens (default: uniform between the shared prefix "
                        "and --prompt-len, so prefill shapes vary as a server's do)")
    p.add_argument("--shared-prefix", type=int, default=1024,
                   help="of those, tokens every prompt of a round shares (prefix-cache hits)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--abort-every", type=int, default=4, help="every N-th request is aborted after 2 tokens")
    p.add_argument("--logprobs-every", type=int, default=4, help="every N-th asks for logprobs (5)")
    p.add_argument("--greedy", action="store_true",
                   help="greedy requests only (default: temperature 0.7 with a seed each, so every "
                        "request has a random generator of its own)")
    p.add_argument("--tracemalloc", action="store_true",
                   help="trace Python's allocations too (slower) and name the lines that grew")
    p.add_argument("--result-json", default=None)
    p.add_argument("--engine-factory", default=None,
                   help="module:callable building the engine from the engine flags (e.g. the CPU "
                        "tiny engine), instead of doublesparse.Engine (as the server's)")
    p.add_argument("--engine-kwargs", default=None, help="JSON merged into the engine flags")
    add_cli_args(p, enable_double_sparsity=True)
    return p


def heap() -> dict:
    from ..server.host_heap import malloc_info
    m = malloc_info() or {}  # not glibc: zeros (the RSS still counts)
    return {"heap_in_use": m.get("in_use", 0), "heap_free": m.get("free", 0), "heap_mmapped": m.get("mmapped", 0),
            "rss": rss()}


def rss() -> int:
    """This process's resident bytes now (Linux; elsewhere its peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def container_sizes(root, depth: int = 2) -> dict[str, int]:
    """len() of every container attribute of ``root`` and its attributes, ``depth`` levels down."""
    out, seen = {}, set()

    def walk(obj, name, d):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for k, v in list(getattr(obj, "__dict__", {}).items()):
            if isinstance(v, CONTAINERS):
                out[f"{name}.{k}"] = len(v)
            elif d > 0 and hasattr(v, "__dict__") and type(v).__module__.startswith("doublesparse"):
                walk(v, f"{name}.{k}", d - 1)
    walk(root, "engine", depth)
    return out


def cudnn_graphs(engine) -> int:
    """Problem shapes the engine's attention backend has let cuDNN build a graph for (torch keeps
    each for good: attention/prefill.py)."""
    return len(getattr(getattr(getattr(engine, "parts", None), "backend", None), "cudnn_shapes", ()))


def one_round(engine, n: int, args, rng: random.Random, vocab: int) -> int:
    """Run ``n`` requests to the end; returns the tokens generated."""
    from ..engine.sampling_params import SamplingParams
    prefix = [rng.randrange(3, vocab) for _ in range(args.shared_prefix)]
    rids, doomed = [], set()
    for i in range(n):
        # lengths vary as a server's do: a per-shape cache anywhere grows with them
        n = args.prompt_len if args.fixed_len else rng.randrange(args.shared_prefix + 1, args.prompt_len + 1)
        ids = prefix + [rng.randrange(3, vocab) for _ in range(n - args.shared_prefix)]
        lp = args.logprobs_every and i % args.logprobs_every == 1
        sp = SamplingParams(max_new_tokens=args.max_tokens, temperature=0.0 if args.greedy else 0.7,
                            seed=None if args.greedy else rng.randrange(1 << 30), ignore_eos=True,
                            logprobs=5 if lp else None, prompt_logprobs=2 if lp else None)
        rid = engine.add_request(ids, sp)
        rids.append(rid)
        if args.abort_every and i % args.abort_every == 0:
            doomed.add(rid)
    seen, tokens = collections.Counter(), 0
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id] += len(out.new_token_ids)
            tokens += len(out.new_token_ids)
            if out.request_id in doomed and seen[out.request_id] >= 2 and not out.finished:
                engine.abort(out.request_id)
                doomed.discard(out.request_id)
    return tokens


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def _main(argv: list[str]) -> int:
    from ..server.cli import build_engine  # the server's engine, from the same flags
    args = build_parser().parse_args(argv)
    engine = build_engine(args)
    vocab = engine.model_config.vocab_size
    if args.shared_prefix >= args.prompt_len:
        args.shared_prefix = args.prompt_len // 2
    rng = random.Random(0)
    traced = args.tracemalloc and not tracemalloc.is_tracing()
    if traced:
        tracemalloc.start(8)
    try:
        return _rounds(args, engine, vocab, rng, argv)
    finally:
        # tracing slows every later allocation of this process many times over (the tests run
        # main() in-process): stop what this run started
        if traced:
            tracemalloc.stop()


def _rounds(args, engine, vocab: int, rng: random.Random, argv: list[str]) -> int:
    rows, snaps, done = [], [], 0
    for r in range(args.rounds + 1):
        t0 = time.perf_counter()
        tokens = one_round(engine, args.requests, args, rng, vocab)
        gc.collect()
        done += args.requests
        row = {"round": r, "requests": done, "tokens": tokens, "s": round(time.perf_counter() - t0, 2), **heap(),
               "containers": container_sizes(engine), "cudnn_graphs": cudnn_graphs(engine)}
        if args.tracemalloc:
            row["traced"] = tracemalloc.get_traced_memory()[0]
            snaps.append(tracemalloc.take_snapshot())
        rows.append(row)
        print(f"[heap] round {r}: {done} requests, heap in use {row['heap_in_use'] / 2**20:.1f} MiB, "
              f"free {row['heap_free'] / 2**20:.1f}, mmapped {row['heap_mmapped'] / 2**20:.1f}, "
              f"RSS {row['rss'] / 2**20:.0f} MiB, cuDNN graphs {row['cudnn_graphs']}"
              + (f", traced {row['traced'] / 2**20:.1f} MiB" if args.tracemalloc else ""), flush=True)
    fit = rows[1:]
    xs = [row["requests"] for row in fit]
    summary = {"requests": done, "rounds": args.rounds,
               "heap_in_use_bytes_per_request": slope(xs, [row["heap_in_use"] for row in fit]),
               "rss_bytes_per_request": slope(xs, [row["rss"] for row in fit]),
               "cudnn_graphs": rows[-1]["cudnn_graphs"]}
    if args.tracemalloc:
        summary["traced_bytes_per_request"] = slope(xs, [row["traced"] for row in fit])
        stats = snaps[-1].compare_to(snaps[1], "lineno")[:12]
        summary["traced_growth_top"] = [f"{s.traceback[0].filename}:{s.traceback[0].lineno} "
                                        f"+{s.size_diff / 1024:.0f} KiB ({s.count_diff:+d} blocks)" for s in stats]
    first, last = fit[0]["containers"], fit[-1]["containers"]
    summary["containers_grown"] = {k: [first.get(k, 0), v] for k, v in last.items() if v > first.get(k, 0)}
    print(json.dumps(summary, indent=1))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"summary": summary, "rounds": rows, "argv": argv}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main("python -m doublesparse.bench.heap", _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
