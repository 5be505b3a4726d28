"""``python -m doublesparse.bench.reliability``: the server's reliability numbers, measured
against a server it starts (the fake engine, or the real one on the CPU with the embedded model).

1. Fan-out + disconnect: one ``/v1/completions`` request of ``--fanout-prompts`` x ``n``
   (128 x 128 = 16,384 engine requests; the server runs with both bounds off so it is accepted),
   whose client hangs up after ``--hold`` seconds. Reports how long after the hang-up the engine
   is idle again (``engine_done_s``, target <= 2 s), and the latency of normal requests sent one
   after another while the fan-out runs against the same request on the idle server
   (``latency_ratio``, target <= 2).
2. rid collisions: a streamed ``/generate`` with a ``rid``; a second request reuses it and hangs
   up; the original must get all its tokens (``intact_pct``, target 100).
3. Soak (:mod:`doublesparse.bench.soak`) for ``--soak-requests`` requests per client (fan-out
   disconnects, rid collisions and out-of-bounds sampling parameters included): 0 5xx, 0 lost.
4. Graceful shutdown: ``--streams`` long streams, SIGTERM, ``--graceful-shutdown-timeout``:
   when each stream ends after the signal, and whether it ends with an error event and ``[DONE]``
   (target: by timeout + 1 s, each with a terminal event).
5. Tracebacks in the server's log over all of it (target 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from . import soak

FAKE = ["--engine-factory", "doublesparse.server.fake_engine:FakeEngine", "--engine-kwargs",
        json.dumps({"step_delay": 0.005, "max_context_len": 2048}), "--max-total-tokens", "65536"]
REAL = ["--device", "cpu", "--max-total-tokens", "16384", "--context-length", "2048"]
NORMAL = {"prompt": "Tell me about the sea.", "max_tokens": 16, "ignore_eos": True, "temperature": 0}


def start_server(args, log_path: Path) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "doublesparse.launch_server", "--port", str(port),
           "--log-level", "info", "--max-choices-per-request", "0", "--max-requests-per-client", "0",
           "--graceful-shutdown-timeout", str(args.shutdown_timeout),
           *(FAKE if args.engine == "fake" else REAL), *args.server_args.split()]
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


async def _idle(c: httpx.AsyncClient, timeout: float = 600, others=lambda: 0) -> float:
    """Seconds until the server holds no request but ``others()`` (still-running probes)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        h = (await c.get("/health")).json()
        k = others()
        if h["in_flight"] <= k and h["running"] <= k and h["waiting"] == 0:
            return time.perf_counter() - t0
        await asyncio.sleep(0.02)
    return float("inf")


async def _latency(c: httpx.AsyncClient) -> float:
    t0 = time.perf_counter()
    r = await c.post("/v1/completions", json=NORMAL)
    r.raise_for_status()
    return time.perf_counter() - t0


async def fanout(c: httpx.AsyncClient, args) -> dict:
    await _latency(c)  # warm-up
    idle = statistics.median([await _latency(c) for _ in range(5)])
    body = {"prompt": [f"Story {i}: once upon a time" for i in range(args.fanout_prompts)],
            "n": args.fanout_n, "max_tokens": 16, "ignore_eos": True, "temperature": 0.8}
    fan = asyncio.create_task(c.post("/v1/completions", json=body, timeout=None))
    t_sent = time.perf_counter()
    busy: list[float] = []

    async def normal_requests():  # one after another while the fan-out's client is there
        await asyncio.sleep(0.5)
        while time.perf_counter() - t_sent < args.hold - idle:
            busy.append(await _latency(c))

    probe = asyncio.create_task(normal_requests())
    await asyncio.sleep(args.hold - (time.perf_counter() - t_sent))
    peak = (await c.get("/health")).json()
    fan.cancel()  # the client hangs up at --hold: the connection closes
    t_left = time.perf_counter()
    try:
        await fan
    except (asyncio.CancelledError, httpx.HTTPError):
        pass
    await _idle(c, others=lambda: 0 if probe.done() else 1)
    done = time.perf_counter() - t_left
    await probe  # a normal request still running finishes
    return {"choices": args.fanout_prompts * args.fanout_n, "hold_s": args.hold,
            "engine_queue_at_hangup": peak["waiting"] + peak["running"],
            "engine_done_s": round(done, 3), "idle_latency_s": round(idle, 3),
            "busy_latencies_s": [round(x, 3) for x in busy],
            "busy_latency_max_s": round(max(busy), 3) if busy else None,
            "latency_ratio": round(max(busy) / idle, 2) if busy else None}


async def rid_collisions(c: httpx.AsyncClient, args) -> dict:
    t = soak.Tally()
    for i in range(args.rid_trials):
        body = {"text": f"Trial {i}: count to ten.", "sampling_params": {
            "max_new_tokens": 64, "ignore_eos": True, "temperature": 0}}
        await soak.check_rid_collision(c, t, body, f"trial-{i}")
    return {"trials": args.rid_trials, "intact": t.rid_intact,
            "intact_pct": 100.0 * t.rid_intact / max(1, args.rid_trials),
            "duplicate_refusals_wrong": t.wrong_4xx[:5], "lost": t.valid_lost[:5]}


def shutdown(proc: subprocess.Popen, url: str, args) -> dict:
    ends: dict[int, dict] = {}
    t_sig = [0.0]

    async def stream(c: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"Stream {i}:", "max_tokens": 1500, "ignore_eos": True, "stream": True,
                "n": 1 + i % 2}
        last = []
        async with c.stream("POST", "/v1/completions", json=body) as r:
            async for ln in r.aiter_lines():
                if ln.startswith("data: "):
                    last = (last + [ln])[-2:]
        ends[i] = {"after_signal_s": round(time.perf_counter() - t_sig[0], 3),
                   "done": bool(last) and last[-1] == "data: [DONE]",
                   "terminal": json.loads(last[0][6:]).get("error", {}).get("code")
                   if len(last) == 2 and last[0].startswith("data: {") else None}

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            tasks = [asyncio.create_task(stream(c, i)) for i in range(args.streams)]
            while (await c.get("/health")).json()["running"] < args.streams:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            t_sig[0] = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())
    rc = proc.wait(60)
    exit_s = time.perf_counter() - t_sig[0]
    return {"timeout_s": args.shutdown_timeout, "streams": [ends.get(i) for i in range(args.streams)],
            "last_stream_end_s": max((e["after_signal_s"] for e in ends.values()), default=None),
            "all_terminal": all(e and e["done"] and e["terminal"] == "shutdown"
                                for e in (ends.get(i) for i in range(args.streams))),
            "process_exit_s": round(exit_s, 3), "exit_code": rc}


def _soak(url: str, args) -> dict:
    s = soak.parse_args(["--base-url", url, "--requests", str(args.soak_requests),
                         "--concurrency", "8", "--oversize-words", "3000",
                         "--burst-words", "700" if args.engine == "real" else "300",
                         "--burst-size", "4", "--seed", "1"])
    r = asyncio.run(soak.run(s))
    out = {k: r[k] for k in ("sent", "lost_valid", "lost_examples", "http_5xx", "wrong_refusals",
                             "fanout_disconnects", "rid_collisions", "rid_collisions_intact",
                             "metrics_consistent", "minutes")}
    out["requests"] = sum(r["sent"].values())
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m doublesparse.bench.reliability",
                                description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("fake", "real"), default="fake")
    p.add_argument("--fanout-prompts", type=int, default=128)
    p.add_argument("--fanout-n", type=int, default=128)
    p.add_argument("--hold", type=float, default=5.0, help="seconds before the fan-out's client leaves")
    p.add_argument("--rid-trials", type=int, default=50)
    p.add_argument("--soak-requests", type=int, default=640, help="per client (8 clients)")
    p.add_argument("--shutdown-timeout", type=float, default=3.0)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--server-args", default="", help="more server flags, e.g. '--max-running-requests 4'")
    p.add_argument("--phases", default="fanout,rid,soak,shutdown", help="which of them to run")
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)
    phases = set(args.phases.split(","))
    log_path = Path(tempfile.mkdtemp()) / "server.log"
    proc, url = start_server(args, log_path)
    res: dict = {"engine": args.engine}
    try:
        async def run_phases():
            async with httpx.AsyncClient(base_url=url, timeout=600) as c:
                if "fanout" in phases:
                    res["fanout"] = await fanout(c, args)
                if "rid" in phases:
                    res["rid_collision"] = await rid_collisions(c, args)
        asyncio.run(run_phases())
        if "soak" in phases:
            res["soak"] = _soak(url, args)
        if "shutdown" in phases:
            res["shutdown"] = shutdown(proc, url, args)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    res["server_log"] = {"tracebacks": log.count("Traceback"),
                         "error_lines": sum("ERROR" in ln for ln in log.splitlines())}
    print(json.dumps(res, indent=1))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
