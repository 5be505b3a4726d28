"""Online serving benchmark against any OpenAI-compatible (or SGLang-native) server.

    python -m doublesparse.bench_serving --base-url http://127.0.0.1:30000 --num-prompts 200 \
        --request-rate 8 --input-len 1024 --output-len 128 --dataset shakespeare

Requests arrive as a Poisson process at ``--request-rate`` (``inf``: all at once), optionally
capped at ``--max-concurrency`` in flight. Every valid request streams. ``--malformed-fraction``
swaps exactly round(f * N) (at least one) requests for invalid ones; those must be refused with a 4xx while the
valid ones still succeed.

Endpoints: ``completions`` / ``chat`` (OpenAI) count streamed text chunks, so a model without a
tokenizer (``--load-format dummy``) streams nothing before its end; ``generate`` (SGLang-native
``/generate`` with ``input_ids``) carries the cumulative ``completion_tokens`` in every event, so
token timing works for dummy weights too.

Latencies are client-side, from the moment a request is sent:
  TTFT  the first chunk that carries a token.
  TPOT  per request (latency - TTFT) / (output_tokens - 1), then percentiles over requests (the
        SGLang/vLLM definition). It includes every stall between first and last token, e.g. other
        requests' prefill chunks that the engine runs in the same steps.
  ITL   every gap between consecutive token-carrying chunks, over all requests: its median is the
        typical decode step, its tail the stalls. A chunk can carry several tokens when the server
        merges events (``multi_token_chunks`` counts those).
Shared prefixes: ``--dataset-name generated-shared-prefix`` (SGLang's workload) sends
``--gsp-num-groups`` x ``--gsp-prompts-per-group`` prompts, each a group's random system prompt of
``--gsp-system-prompt-len`` tokens plus its own random question of ``--gsp-question-len`` tokens, for
``--gsp-output-len`` tokens each, in a shuffled order. The report then splits TTFT into the first
request sent of each group (cold: its prefix is computed) and the rest (warm: a prefix cache can
reuse it), and gives the server's prefix-cache hit rate over the run (prompt tokens found in the
cache / prompt tokens, from its /metrics).

``--deadline`` ends the run at a wall-clock limit: nothing more is sent, requests in flight are
cancelled (the server aborts them on disconnect), and the report covers what finished; tokens of
the cut requests are counted separately (``*_incl_cut``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
import dataclasses
from dataclasses import dataclass, field

import httpx

from .serving_workload import GSP, Spec, build_workload
from ..kernels.tuning import KernelTuning

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "generate": "/generate"}


@dataclass
class Result:
    ok: bool = False
    malformed: bool = False
    cancelled: bool = False     # in flight when the deadline came
    not_sent: bool = False      # the deadline came before it was sent
    group: int | None = None    # generated-shared-prefix: the prompt's group
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0      # grows while streaming, so cut requests still count
    multi_token_chunks: int = 0
    itl: list[float] = field(default_factory=list)

    @property
    def cut(self) -> bool:
        return self.cancelled or self.not_sent

    @property
    def finished(self) -> bool:
        """Answered (well or badly); False while waiting, in flight, or cut."""
        return self.ok or (self.error is not None and not self.cut)


# ------------------------------------------------------------------------------ client
def _new_tokens(ev: dict, res: Result) -> int:
    """Tokens this stream event adds (0 for bookkeeping events); updates the counts in ``res``."""
    meta = ev.get("meta_info")
    if isinstance(meta, dict):  # /generate: cumulative counts in every event
        n = max(0, int(meta.get("completion_tokens") or 0) - res.output_tokens)
        res.prompt_tokens = int(meta.get("prompt_tokens") or res.prompt_tokens)
        res.output_tokens += n
        return n
    if ev.get("usage"):  # OpenAI's closing usage event holds the true counts
        res.prompt_tokens = ev["usage"].get("prompt_tokens", 0)
        res.output_tokens = ev["usage"].get("completion_tokens", 0) or res.output_tokens
        return 0
    pieces = sum(1 for ch in ev.get("choices") or []
                 if ch.get("text") or (ch.get("delta") or {}).get("content"))
    res.output_tokens += pieces
    return pieces


async def send(client: httpx.AsyncClient, path: str, spec: Spec, res: Result | None = None) -> Result:
    res = res or Result(malformed=spec.malformed_kind is not None)
    t0 = time.perf_counter()
    try:
        if spec.raw is not None:
            r = await client.post(path, content=spec.raw, headers={"Content-Type": "application/json"})
            res.status = r.status_code
            res.ok = 400 <= r.status_code < 500 and "error" in r.json()
            if not res.ok:
                res.error = f"{spec.malformed_kind}: HTTP {r.status_code} {r.text[:200]}"
            return res
        async with client.stream("POST", path, json=spec.body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            last = t0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    res.error = str(ev["error"])[:200]
                    return res
                n = _new_tokens(ev, res)
                if n:
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    res.multi_token_chunks += n > 1
                    last = now
            res.ok = True
    except Exception as e:  # any failure is this request's, never the run's (cancel is not one)
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.latency = time.perf_counter() - t0
    return res


async def run(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts or 1,
                          max_keepalive_connections=args.max_concurrency or 100)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers,
                                 timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        model = args.model or await _first_model(client)
        specs = build_workload(args, model)
        path = PATHS[args.endpoint]
        if args.warmup_requests:  # first-call costs (kernel compiles, allocator growth) stay out
            warm = build_workload(args, model, args.warmup_requests, args.warmup_input_len,
                                  args.warmup_output_len, malformed=False)
            t = time.perf_counter()
            rs = await asyncio.gather(*(send(client, path, s) for s in warm))
            _say(f"warm-up: {sum(r.ok for r in rs)}/{len(rs)} ok in {time.perf_counter() - t:.1f} s")
        before = await server_counters(client)
        results = [Result(malformed=s.malformed_kind is not None, group=s.group) for s in specs]
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = random.Random(args.seed + 1)
        bar = _progress(len(specs), args.disable_tqdm or args.progress_interval > 0)
        tasks: list[asyncio.Task] = []

        async def one(spec: Spec, res: Result) -> None:
            sent = False
            try:
                async with sem or contextlib.nullcontext():
                    sent = True
                    await send(client, path, spec, res)
            except asyncio.CancelledError:  # the deadline
                res.cancelled, res.not_sent = sent, not sent
            finally:
                bar.update(1)

        async def launch() -> None:
            for spec, res in zip(specs, results):  # Poisson arrivals: exponential gaps
                tasks.append(asyncio.create_task(one(spec, res)))
                if math.isfinite(args.request_rate) and args.request_rate > 0:
                    await asyncio.sleep(rng.expovariate(args.request_rate))
            await asyncio.gather(*tasks)

        t_start = time.perf_counter()
        reporter = asyncio.create_task(_report_loop(args, results, t_start))
        try:
            await asyncio.wait_for(launch(), args.deadline)
        except asyncio.TimeoutError:
            _say(f"deadline of {args.deadline:.0f} s reached: cutting the run")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for res in results[len(tasks):]:  # never even created: the deadline came during arrivals
            res.not_sent = True
        duration = time.perf_counter() - t_start
        reporter.cancel()
        bar.close()
        after = await server_counters(client)
    out = summarize(results, duration, args.output_len if args.ignore_eos else None)
    counters = counter_deltas(before, after)
    out.update(model=model, base_url=args.base_url, endpoint=args.endpoint, dataset=args.dataset,
               request_rate=_finite(args.request_rate), max_concurrency=args.max_concurrency,
               input_len=args.input_len, output_len=args.output_len, deadline=args.deadline,
               prefix_cache_hit_rate=hit_rate(counters), server_counters=counters,
               # per valid request in arrival order, for later analysis (e.g. first wave vs the
               # rest): [ok, ttft s, latency s, output tokens, longest gap s]
               per_request=[[r.ok, r.ttft, r.latency, r.output_tokens, max(r.itl, default=None)]
                            for r in results if not r.malformed])
    return out


async def _first_model(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def server_counters(client: httpx.AsyncClient) -> dict | None:
    """Unlabelled ``doublesparse_*`` series of the server's /metrics (None if it has none)."""
    try:
        r = await client.get("/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out = {}
    for line in r.text.splitlines():
        name, _, v = line.partition(" ")
        if name.startswith("doublesparse_") and "{" not in name:
            with contextlib.suppress(ValueError):
                out[name] = float(v)
    return out


def hit_rate(counters: dict | None) -> float | None:
    """Prompt tokens the server found in its prefix cache / prompt tokens it admitted, over the
    run (None: the server exports no such counters)."""
    c = counters or {}
    q = c.get("prefix_cache_query_tokens")
    return c.get("prefix_cache_hit_tokens", 0.0) / q if q else None


def counter_deltas(before: dict | None, after: dict | None) -> dict | None:
    """What the run added to each counter (e.g. decode steps, and how many of them were sparse)."""
    if before is None or after is None:
        return None
    return {k.removeprefix("doublesparse_").removesuffix("_total"): after[k] - before[k]
            for k in after if k.endswith("_total") and k in before}


async def _report_loop(args, results: list[Result], t_start: float) -> None:
    """Progress lines every --progress-interval s; with --result-json also a partial snapshot, so
    a run killed from outside still leaves numbers behind."""
    if args.progress_interval <= 0:
        return
    while True:
        await asyncio.sleep(args.progress_interval)
        el = time.perf_counter() - t_start
        m = summarize(results, el, None)
        _say(f"[{el:6.0f} s] done {m['completed']}/{m['valid_requests']} "
                   f"errors {m['errors']} out tok/s {m['output_throughput_incl_cut']:.0f} "
                   f"tpot p50 {m['tpot_ms_p50'] or 0:.1f} ms itl p50 {m['itl_ms_p50'] or 0:.1f} ms")
        if args.result_json:
            write_json(args, m, partial=True)


def _say(msg: str) -> None:
    print(msg, flush=True)


def _progress(total: int, disable: bool):
    try:
        from tqdm.auto import tqdm
        return tqdm(total=total, disable=disable, desc="requests")
    except ImportError:  # tqdm is a dependency, but a bare client machine may lack it
        class _Null:
            def update(self, n): ...
            def close(self): ...
        return _Null()


# ------------------------------------------------------------------------------ report
def pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank-with-interpolation percentile; None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _dist(name: str, xs: list[float], qs=(50, 90, 99)) -> dict:
    ms = {f"{name}_ms_mean": sum(xs) / len(xs) * 1e3 if xs else None}
    ms.update({f"{name}_ms_p{q}": None if not xs else pct(xs, q) * 1e3 for q in qs})
    return ms


def cold_warm_ttft(results: list[Result]) -> dict:
    """TTFT of the first request sent of each group (cold) and of the others (warm), p50 in ms
    and their ratio; empty without groups."""
    valid = [r for r in results if not r.malformed and r.group is not None]
    if not valid:
        return {}
    seen: set = set()
    cold, warm = [], []
    for r in valid:  # in sending order
        (warm if r.group in seen else cold).append(r)
        seen.add(r.group)
    c = [r.ttft for r in cold if r.ok and r.ttft is not None]
    w = [r.ttft for r in warm if r.ok and r.ttft is not None]
    c50, w50 = pct(c, 50), pct(w, 50)
    return {"ttft_cold_ms_p50": None if c50 is None else c50 * 1e3,
            "ttft_warm_ms_p50": None if w50 is None else w50 * 1e3,
            "ttft_warm_over_cold_p50": w50 / c50 if c50 and w50 is not None else None}


def summarize(results: list[Result], duration: float, output_len: int | None = None) -> dict:
    valid = [r for r in results if not r.malformed]
    bad = [r for r in results if r.malformed and r.finished]
    done = [r for r in valid if r.ok]
    ttft = [r.ttft for r in done if r.ttft is not None]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done
            if r.ttft is not None and r.output_tokens > 1]
    itl = [x for r in done for x in r.itl]
    out_tok = sum(r.output_tokens for r in done)
    out_all = sum(r.output_tokens for r in valid)  # includes what cut requests had streamed
    rate = (lambda n: n / duration if duration else 0.0)  # noqa: E731
    return {
        "duration_s": duration, "num_requests": len(results), "valid_requests": len(valid),
        "completed": len(done), "errors": sum(r.finished and not r.ok for r in valid),
        "cancelled_in_flight": sum(r.cancelled for r in results),
        "not_sent": sum(r.not_sent for r in results),
        "malformed_sent": len(bad), "malformed_rejected": sum(r.ok for r in bad),
        "malformed_unexpected": sum(not r.ok for r in bad),
        "request_throughput": rate(len(done)), "output_throughput": rate(out_tok),
        "output_throughput_incl_cut": rate(out_all),
        "total_prompt_tokens": sum(r.prompt_tokens for r in done), "total_output_tokens": out_tok,
        "total_output_tokens_incl_cut": out_all,
        "output_len_mismatch": None if output_len is None else
        sum(r.output_tokens != output_len for r in done),
        "multi_token_chunks": sum(r.multi_token_chunks for r in done),
        **_dist("ttft", ttft, (50, 99)), **cold_warm_ttft(results), **_dist("tpot", tpot),
        **_dist("itl", itl),
        **{k.replace("latency", "e2e"): v for k, v in
           _dist("latency", [r.latency for r in done], (50, 99)).items()},
        "error_samples": sorted({r.error for r in results if r.error})[:5],
    }


def _finite(v):
    """JSON has no Infinity: report an unlimited rate as the string "inf"."""
    return "inf" if isinstance(v, float) and math.isinf(v) else v


def print_report(m: dict) -> None:
    print(f"{' Serving benchmark ':=^60}")
    for k, v in m.items():
        if isinstance(v, (dict, list)) or k == "server_counters":
            continue
        print(f"{k:<28}{v:>32.2f}" if isinstance(v, float) else f"{k:<28}{str(v):>32}")
    for k, v in (m.get("server_counters") or {}).items():
        print(f"server {k:<21}{v:>32.0f}")
    for e in m.get("error_samples") or []:
        print("  error:", e)
    print("=" * 60)


def write_json(args, metrics: dict, partial: bool) -> None:
    tmp = args.result_json + ".tmp"  # replace atomically: a reader never sees half a file
    with open(tmp, "w") as f:
        json.dump({"args": {k: _finite(v) for k, v in vars(args).items() if k not in ("api_key", "kernel_tuning")},
                   "kernel_tuning": dataclasses.asdict(args.kernel_tuning),
                   "partial": partial, "metrics": metrics}, f, indent=2, default=str)
    os.replace(tmp, args.result_json)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m doublesparse.bench_serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="default: the first entry of /v1/models")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--endpoint", choices=tuple(PATHS), default="completions")
    p.add_argument("--dataset", "--dataset-name", dest="dataset", choices=("random", "shakespeare", GSP),
                   default="random")
    g = p.add_argument_group(f"{GSP} (SGLang's names)")
    g.add_argument("--gsp-num-groups", type=int, default=64, help="groups (distinct system prompts)")
    g.add_argument("--gsp-prompts-per-group", type=int, default=16, help="questions per group")
    g.add_argument("--gsp-system-prompt-len", type=int, default=2048, help="system prompt tokens")
    g.add_argument("--gsp-question-len", type=int, default=128, help="question tokens")
    g.add_argument("--gsp-output-len", type=int, default=256, help="output tokens per request")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in requests/s (inf: send all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (approximate for text)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly --output-len tokens (server extension)")
    p.add_argument("--random-token-low", type=int, default=100)
    p.add_argument("--random-token-high", type=int, default=10_000)
    p.add_argument("--malformed-fraction", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--deadline", type=float, default=None,
                   help="end the run after this many seconds (cut requests are reported apart)")
    p.add_argument("--warmup-requests", type=int, default=0,
                   help="requests sent (concurrently) before the measured run")
    p.add_argument("--warmup-input-len", type=int, default=256)
    p.add_argument("--warmup-output-len", type=int, default=4)
    p.add_argument("--progress-interval", type=float, default=0.0,
                   help="print progress (and write a partial --result-json) every this many s")
    p.add_argument("--result-json", default=None)
    p.add_argument("--kernel-tuning", type=KernelTuning.from_json, default=KernelTuning(), metavar="FILE.json",
                   help="the --kernel-tuning file the server runs with, recorded in --result-json "
                        "(default: the defaults)")
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    if not 0.0 <= args.malformed_fraction <= 1.0:
        p.error("--malformed-fraction must be in [0, 1]")
    if args.input_len < 1 or args.output_len < 1 or args.num_prompts < 1:
        p.error("--input-len, --output-len and --num-prompts must be >= 1")
    if args.deadline is not None and args.deadline <= 0:
        p.error("--deadline must be > 0")
    if args.dataset == GSP:
        if min(args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len,
               args.gsp_question_len, args.gsp_output_len) < 1:
            p.error("the --gsp-* values must be >= 1")
        # the workload fixes these; the report and the length checks read them
        args.num_prompts = args.gsp_num_groups * args.gsp_prompts_per_group
        args.input_len = args.gsp_system_prompt_len + args.gsp_question_len
        args.output_len = args.gsp_output_len
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    metrics = asyncio.run(run(args))
    print_report(metrics)
    if args.result_json:
        write_json(args, metrics, partial=False)
    # Non-zero when valid requests failed or a malformed one was not refused properly (requests
    # cut by --deadline are neither: they are reported as cancelled_in_flight / not_sent).
    return 0 if metrics["errors"] == 0 and metrics["malformed_unexpected"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
