"""``python -m doublesparse.bench.soak``: a mixed load against a running server for a fixed time.

Every worker loops until the deadline (or, with ``--requests N``, for N requests: the same mix
whatever the machine's speed), each time sending one request of a kind drawn by weight:
valid completions and streamed chat requests, oversize prompts and malformed bodies (which must get
a 4xx), streams the client drops after their first tokens, greedy duplicates of one fixed request
(which must all give the same text), and bursts of long prompts that fill the KV pool (which must
queue and complete). Reports lost valid requests, 5xx answers, whether the duplicates agree,
latency percentiles of valid requests, the server's RSS growth over the run's second half, and
whether ``/metrics`` counted what the client saw.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..bench_serving import pct

KINDS = {"valid": 5, "stream": 3, "oversize": 1, "malformed": 2, "disconnect": 1, "duplicate": 2,
         "burst": 1}
MALFORMED = [b"{not json", b"[1, 2]", b'{"prompt": 5}', b'{"prompt": "hi", "max_tokens": "x"}',
             b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "top_k": 1180591620717411303424}',
             b'{"prompt": "hi", "top_p": 1e-300}', b'{"messages": []}']
DUPLICATE = {"prompt": "Count slowly: one, two,", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@dataclass
class Tally:
    sent: dict = field(default_factory=dict)
    valid_ok: int = 0
    valid_lost: list = field(default_factory=list)
    http_5xx: int = 0
    wrong_4xx: list = field(default_factory=list)   # a refusal the server owed, answered otherwise
    latencies: list = field(default_factory=list)
    duplicates: list = field(default_factory=list)
    rss: list = field(default_factory=list)          # (seconds since start, bytes)

    def count(self, kind: str) -> None:
        self.sent[kind] = self.sent.get(kind, 0) + 1


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def _valid(c: httpx.AsyncClient, t: Tally, body: dict, path="/v1/completions") -> str | None:
    t0 = time.perf_counter()
    try:
        r = await c.post(path, json=body)
    except httpx.HTTPError as e:
        t.valid_lost.append(f"{path}: {type(e).__name__}")
        return None
    if r.status_code >= 500:
        t.http_5xx += 1
    if r.status_code != 200:
        t.valid_lost.append(f"{path}: {r.status_code} {r.text[:120]}")
        return None
    t.valid_ok += 1
    t.latencies.append(time.perf_counter() - t0)
    ch = r.json()["choices"][0]
    return ch.get("text", (ch.get("message") or {}).get("content"))


async def _stream(c: httpx.AsyncClient, t: Tally, body: dict, drop_after: int | None) -> None:
    t0 = time.perf_counter()
    chunks, done = 0, False
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    try:
        async with c.stream("POST", path, json={**body, "stream": True}) as r:
            if r.status_code >= 500:
                t.http_5xx += 1
            if r.status_code != 200:
                t.valid_lost.append(f"stream: {r.status_code}")
                return
            async for ln in r.aiter_lines():
                if ln == "data: [DONE]":
                    done = True
                elif ln.startswith("data: {"):
                    ev = json.loads(ln[6:])
                    if "error" in ev:
                        t.valid_lost.append(f"stream error event: {ev['error']}")
                        return
                    chunks += 1
                    if drop_after is not None and chunks >= drop_after:
                        return  # the client goes away; the server must free the request
    except httpx.HTTPError as e:
        t.valid_lost.append(f"stream: {type(e).__name__}")
        return
    if drop_after is None:
        if done:
            t.valid_ok += 1
            t.latencies.append(time.perf_counter() - t0)
        else:
            t.valid_lost.append("stream ended without [DONE]")


async def _refused(c: httpx.AsyncClient, t: Tally, raw: bytes, path="/v1/completions") -> None:
    r = await c.post(path, content=raw)
    if r.status_code >= 500:
        t.http_5xx += 1
    elif not 400 <= r.status_code < 500:
        t.wrong_4xx.append(f"{raw[:60]!r}: {r.status_code}")


async def worker(c: httpx.AsyncClient, t: Tally, rng: random.Random, deadline: float, args) -> None:
    """Requests until ``deadline`` (monotonic seconds), or ``args.requests`` of them when set."""
    kinds, weights = zip(*KINDS.items())
    words = "the of and to a in that is was he for it with as his on be at by".split()

    def prompt(n: int):
        # token ids for a model without a tokenizer (dummy weights), else words
        if args.token_ids:
            return [rng.randrange(10, args.vocab_size) for _ in range(n)]
        return " ".join(rng.choice(words) for _ in range(n))

    def chat(p):
        return {"prompt": p} if args.token_ids else {"messages": [{"role": "user", "content": p}]}

    sent = 0
    while (sent < args.requests) if args.requests else (time.monotonic() < deadline):
        sent += 1
        kind = rng.choices(kinds, weights)[0]
        t.count(kind)
        text = prompt(rng.randrange(5, args.prompt_words))
        sample = {"temperature": rng.choice([0, 0.7, 1.0]), "top_p": rng.choice([1.0, 0.9]),
                  "max_tokens": rng.randrange(1, args.max_tokens + 1), "seed": rng.randrange(1 << 30)}
        if kind == "valid":
            await _valid(c, t, {"prompt": text, **sample})
        elif kind == "stream":
            await _stream(c, t, {**chat(text), **sample}, None)
        elif kind == "oversize":
            await _refused(c, t, json.dumps({"prompt": prompt(args.oversize_words)}).encode())
        elif kind == "malformed":
            await _refused(c, t, rng.choice(MALFORMED),
                           rng.choice(["/v1/completions", "/v1/chat/completions"]))
        elif kind == "disconnect":
            # long enough to be still running when the client goes away
            await _stream(c, t, {**chat(text), **{**sample, "max_tokens": 200, "ignore_eos": True}},
                          drop_after=1)
        elif kind == "duplicate":
            out = await _valid(c, t, {**DUPLICATE, "prompt": list(range(100, 140))} if args.token_ids
                               else DUPLICATE)
            if out is not None:
                t.duplicates.append(out)
        elif kind == "burst":
            long = prompt(args.burst_words)
            await asyncio.gather(*(_valid(c, t, {"prompt": long, "max_tokens": 2, "temperature": 0})
                                   for _ in range(args.burst_size)))


async def _metric(c: httpx.AsyncClient, name: str) -> dict:
    """``{labels: value}`` of one counter family in ``/metrics``."""
    out = {}
    for line in (await c.get("/metrics")).text.splitlines():
        if line.startswith(name):
            key, val = line.rsplit(" ", 1)
            out[key[len(name):]] = float(val)
    return out


async def _metric_rss(c: httpx.AsyncClient) -> int | None:
    """The server's resident memory from its ``/metrics`` (``process_resident_memory_bytes``)."""
    try:
        v = (await _metric(c, "process_resident_memory_bytes")).get("")
    except httpx.HTTPError:
        return None
    return int(v) if v is not None else None


async def run(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    t = Tally()
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.timeout) as c:
        before = await _metric(c, "doublesparse_requests_total")
        start = time.monotonic()
        deadline = start + args.duration
        done = asyncio.Event()

        async def sample_rss():
            while not done.is_set():
                b = rss_bytes(args.server_pid) if args.server_pid else await _metric_rss(c)
                if b is not None:
                    t.rss.append((time.monotonic() - start, b))
                try:
                    await asyncio.wait_for(done.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass

        async def load():
            rng = random.Random(args.seed)
            await asyncio.gather(*(worker(c, t, random.Random(rng.random()), deadline, args)
                                   for _ in range(args.concurrency)))
            done.set()

        await asyncio.gather(sample_rss(), load())
        seconds = time.monotonic() - start
        for _ in range(100):  # the server finishes dropped streams in its own time
            h = (await c.get("/health")).json()
            if h.get("in_flight") == 0 and h.get("running") == 0 and h.get("waiting") == 0:
                break
            await asyncio.sleep(0.2)
        after = await _metric(c, "doublesparse_requests_total")
    # A dropped stream ends on the server as "disconnected", or finished if it was done first.
    ended = ('status="stop"', 'status="length"', 'status="disconnected"', 'status="abort"')
    served = sum(v - before.get(k, 0.0) for k, v in after.items() if any(e in k for e in ended))
    expected = t.valid_ok + t.sent.get("disconnect", 0)
    half = [b for s, b in t.rss if s >= seconds / 2]
    lat = t.latencies
    return {
        "minutes": seconds / 60, "concurrency": args.concurrency, "sent": t.sent,
        "valid_ok": t.valid_ok, "lost_valid": len(t.valid_lost), "lost_examples": t.valid_lost[:10],
        "http_5xx": t.http_5xx, "wrong_refusals": t.wrong_4xx[:10],
        "duplicates": len(t.duplicates), "duplicates_identical": int(len(set(t.duplicates)) <= 1),
        "latency_s": {q: pct(lat, q) for q in (50, 90, 99)},
        "rss_growth_pct": 100 * (half[-1] / half[0] - 1) if len(half) >= 2 else None,
        "rss_max_mb": max((b for _, b in t.rss), default=0) / 2**20,
        "server_ended": served, "client_expected": expected, "metrics_consistent": int(served == expected),
        "mean_latency_s": statistics.mean(lat) if lat else None,
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m doublesparse.bench.soak", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--requests", type=int, default=0,
                   help="each client sends this many requests, then stops (instead of --duration)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--oversize-words", type=int, default=40000, help="a prompt past any context here")
    p.add_argument("--burst-size", type=int, default=6)
    p.add_argument("--burst-words", type=int, default=1500, help="words of each burst prompt")
    p.add_argument("--server-pid", type=int, default=None,
                   help="read its RSS from /proc (default: the server's /metrics process_resident_memory_bytes)")
    p.add_argument("--vocab-size", type=int, default=32000, help="with --token-ids: ids below this")
    p.add_argument("--token-ids", action="store_true",
                   help="prompts as token ids (a model without a tokenizer: --load-format dummy)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    res = asyncio.run(run(args))
    print(json.dumps(res, indent=1))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(res, indent=1) + "\n")
    ok = res["lost_valid"] == 0 and res["http_5xx"] == 0 and res["duplicates_identical"] and res["metrics_consistent"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
