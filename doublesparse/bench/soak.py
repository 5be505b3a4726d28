"""``python -m doublesparse.bench.soak``: a mixed load against a running server for a fixed time.

Every worker loops until the deadline (or, with ``--requests N``, for N requests: the same mix
whatever the machine's speed), each time sending one request of a kind drawn by weight:
valid completions and streamed chat requests, oversize prompts and malformed bodies (which must get
a 4xx), streams the client drops after their first tokens, greedy duplicates of one fixed request
(which must all give the same text), bursts of long prompts that fill the KV pool (which must
queue and complete), fanned-out completions (prompts x n) whose client hangs up while they run
(every sibling must leave the engine), and ``/generate`` requests whose ``rid`` a second request
reuses and then drops (the duplicate must get a 400 and the original all its tokens). Reports
lost valid requests, 5xx answers, whether the duplicates agree, latency percentiles of valid
requests, the server's RSS growth over the run's second half (its floor: the lowest sample of the
half's last quarter against its first's), and whether ``/metrics`` counted what the client saw
(each sibling of a fan-out is one request there).
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

from .serving import pct

KINDS = {"valid": 5, "stream": 3, "oversize": 1, "malformed": 2, "disconnect": 1, "duplicate": 2,
         "burst": 1, "fanout_disconnect": 1, "rid_collision": 1}
MALFORMED = [b"{not json", b"[1, 2]", b'{"prompt": 5}', b'{"prompt": "hi", "max_tokens": "x"}',
             b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "top_k": 1180591620717411303424}',
             b'{"prompt": "hi", "top_p": 1e-300}', b'{"messages": []}',
             b'{"prompt": "hi", "repetition_penalty": 5e-38, "temperature": 1}',
             b'{"prompt": "hi", "repetition_penalty": 1e-45}', b'{"prompt": "hi", "n": 129}',
             b'{"prompt": "hi", "best_of": 2, "n": 3}']
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
    runtime: list = field(default_factory=list)      # (seconds since start, {gauge: value})
    fanout_disconnects: int = 0     # fanned-out requests whose client hung up while they ran
    fanout_siblings: int = 0        # their engine requests (each ends once in /metrics)
    rid_collisions: int = 0         # originals whose rid a second request reused
    rid_intact: int = 0             # ... that still got every token

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


async def _fanout_disconnect(c: httpx.AsyncClient, t: Tally, body: dict, hold: float) -> None:
    """A fanned-out request whose client hangs up after ``hold`` seconds."""
    k = len(body["prompt"]) * body["n"]
    try:
        r = await asyncio.wait_for(c.post("/v1/completions", json=body), hold)
    except asyncio.TimeoutError:  # the client leaves: the server must drop every sibling
        t.fanout_disconnects += 1
        t.fanout_siblings += k
        return
    except httpx.HTTPError as e:
        t.valid_lost.append(f"fan-out: {type(e).__name__}")
        return
    if r.status_code >= 500:
        t.http_5xx += 1
    if r.status_code != 200:
        t.valid_lost.append(f"fan-out: {r.status_code} {r.text[:120]}")
        return
    t.fanout_siblings += k  # finished before the client left: each sibling ended normally


async def check_rid_collision(c: httpx.AsyncClient, t: Tally, body: dict, rid: str) -> None:
    """A streamed /generate with ``rid``; meanwhile a second one reuses the rid (a 400 is owed)
    and hangs up. The original must still get all its tokens."""
    want = body["sampling_params"]["max_new_tokens"]
    last, dup = None, None
    t0 = time.perf_counter()
    try:
        async with c.stream("POST", "/generate", json={**body, "rid": rid, "stream": True}) as r:
            if r.status_code != 200:
                t.http_5xx += r.status_code >= 500
                t.valid_lost.append(f"rid original: {r.status_code}")
                return
            async for ln in r.aiter_lines():
                if not ln.startswith("data: {"):
                    continue
                last = json.loads(ln[6:])
                if dup is None:  # the duplicate: read its status, then hang up
                    async with c.stream("POST", "/generate", json={**body, "rid": rid}) as d:
                        dup = d.status_code
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        t.valid_lost.append(f"rid collision: {type(e).__name__}")
        return
    t.rid_collisions += 1
    if dup is not None and dup >= 500:
        t.http_5xx += 1
    if dup != 400:
        t.wrong_4xx.append(f"duplicate rid: {dup if dup is not None else 'not sent'}")
    meta = (last or {}).get("meta_info") or {}
    if "error" in (last or {}) or meta.get("completion_tokens") != want:
        t.valid_lost.append(f"rid original cut: {json.dumps(last)[:160]}")
        return
    t.rid_intact += 1
    t.valid_ok += 1
    t.latencies.append(time.perf_counter() - t0)


def kind_sequence(seed: int, client: int):
    """The kinds client ``client`` sends, in order (its own stream of draws, so the sequence does
    not depend on the other arguments)."""
    rng = random.Random(f"{seed}-{client}")
    kinds, weights = zip(*KINDS.items())
    while True:
        yield rng.choices(kinds, weights)[0]


async def worker(c: httpx.AsyncClient, t: Tally, rng: random.Random, deadline: float, args,
                 client: int = 0) -> None:
    """Requests until ``deadline`` (monotonic seconds), or ``args.requests`` of them when set."""
    next_kind = kind_sequence(args.seed, client)
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
        kind = next(next_kind)
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
        elif kind == "fanout_disconnect":
            body = {"prompt": [prompt(rng.randrange(5, args.prompt_words))
                               for _ in range(args.fanout_prompts)],
                    "n": args.fanout_n, "max_tokens": 200, "ignore_eos": True, "temperature": 0.7}
            await _fanout_disconnect(c, t, body, args.fanout_hold)
        elif kind == "rid_collision":
            key = "input_ids" if args.token_ids else "text"
            body = {key: prompt(rng.randrange(5, args.prompt_words)), "sampling_params": {
                "max_new_tokens": args.max_tokens + 8, "ignore_eos": True, "temperature": 0}}
            await check_rid_collision(c, t, body, f"soak-{client}-{sent}")


def _family(text: str, name: str) -> dict:
    """``{labels: value}`` of one metric family in a ``/metrics`` page."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name):
            key, val = line.rsplit(" ", 1)
            out[key[len(name):]] = float(val)
    return out


async def _metric(c: httpx.AsyncClient, name: str) -> dict:
    """``{labels: value}`` of one counter family in ``/metrics``."""
    return _family((await c.get("/metrics")).text, name)


def _every(samples: list, step: float) -> list:
    """(seconds, MB) of ``samples`` ((seconds, bytes), ascending) at most one per ``step`` seconds,
    and the last one."""
    out, nxt = [], 0.0
    for i, (sec, b) in enumerate(samples):
        if sec >= nxt or i == len(samples) - 1:
            out.append((round(sec, 1), round(b / 2**20, 1)))
            nxt = sec + step
    return out


# where a server's resident memory can go (server/metrics.py _RuntimeCollector), and the prefix
# cache's fill, whose host-side tree grows with it
RUNTIME_GAUGES = ("host_pinned_bytes", "cuda_memory_reserved_bytes", "triton_kernels_compiled",
                  "malloc_in_use_bytes", "malloc_free_bytes", "malloc_mmapped_bytes",
                  "kv_pool_cached_tokens", "kv_pool_used_tokens")


async def _runtime_gauges(c: httpx.AsyncClient) -> dict:
    """The :data:`RUNTIME_GAUGES` the server reports, from one scrape."""
    try:
        text = (await c.get("/metrics")).text
    except httpx.HTTPError:
        return {}
    found = {g: _family(text, f"doublesparse_{g} ").get("") for g in RUNTIME_GAUGES}
    return {g: v for g, v in found.items() if v is not None}


async def _metric_rss(c: httpx.AsyncClient) -> int | None:
    """The server's resident memory from its ``/metrics`` (``process_resident_memory_bytes``)."""
    try:
        v = (await _metric(c, "process_resident_memory_bytes")).get("")
    except httpx.HTTPError:
        return None
    return int(v) if v is not None else None


def rss_growth_pct(samples: list[tuple[float, int]], seconds: float) -> float | None:
    """RSS growth over the run's second half, in percent: the lowest sample of the half's last
    quarter against the lowest of its first. Lowest, because a burst's buffers raise the RSS for
    seconds and then go back (a leak raises the floor); None with too few samples."""
    half = [(s, b) for s, b in samples if s >= seconds / 2]
    if len(half) < 2:
        return None
    span = (half[-1][0] - half[0][0]) / 4
    first = min(b for s, b in half if s <= half[0][0] + span)
    last = min(b for s, b in half if s >= half[-1][0] - span)
    return 100 * (last / first - 1)


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
                if not t.runtime or time.monotonic() - start - t.runtime[-1][0] >= 30.0:
                    g = await _runtime_gauges(c)
                    if g:
                        t.runtime.append((time.monotonic() - start, g))
                try:
                    await asyncio.wait_for(done.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass

        async def load():
            rng = random.Random(args.seed)
            await asyncio.gather(*(worker(c, t, random.Random(rng.random()), deadline, args, i)
                                   for i in range(args.concurrency)))
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
    # a collided original is in valid_ok; a fan-out is one request per sibling there
    expected = t.valid_ok + t.sent.get("disconnect", 0) + t.fanout_siblings
    lat = t.latencies
    return {
        "minutes": seconds / 60, "concurrency": args.concurrency, "sent": t.sent,
        "valid_ok": t.valid_ok, "lost_valid": len(t.valid_lost), "lost_examples": t.valid_lost[:10],
        "http_5xx": t.http_5xx, "wrong_refusals": t.wrong_4xx[:10],
        "fanout_disconnects": t.fanout_disconnects, "rid_collisions": t.rid_collisions,
        "rid_collisions_intact": t.rid_intact,
        "duplicates": len(t.duplicates), "duplicates_identical": int(len(set(t.duplicates)) <= 1),
        "latency_s": {q: pct(lat, q) for q in (50, 90, 99)},
        "rss_growth_pct": rss_growth_pct(t.rss, seconds),
        "rss_max_mb": max((b for _, b in t.rss), default=0) / 2**20,
        # the server's RSS every ~30 s (seconds, MB): whether a growth plateaus or keeps on
        "rss_mb_series": _every(t.rss, 30.0),
        # beside it: page-locked host pool, CUDA reserve, compiled Triton variants (absent on CPU)
        "runtime_series": [(round(sec, 1), g) for sec, g in t.runtime],
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
    p.add_argument("--fanout-prompts", type=int, default=4, help="prompts of a fanned-out request")
    p.add_argument("--fanout-n", type=int, default=8, help="n of a fanned-out request")
    p.add_argument("--fanout-hold", type=float, default=0.5,
                   help="seconds before a fanned-out request's client hangs up")
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
    ok = (res["lost_valid"] == 0 and res["http_5xx"] == 0 and res["duplicates_identical"]
          and res["metrics_consistent"] and not res["wrong_refusals"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
