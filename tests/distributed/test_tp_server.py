"""A server at --tp-size 2 (CPU, gloo, the tiny random Llama) whose rank 1 is killed: the next
request gets an error naming the rank, /health answers 503 "engine_dead" with that reason, later
requests are refused with it, and the server process stays answerable and stops cleanly."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_utils import AUTH, Server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="finds the rank's process through /proc")

ARGS = ["--engine-factory", "doublesparse.server.fake_engine:tiny_engine", "--tp-size", "2",
        "--max-total-tokens", "2048", "--context-length", "512", "--no-enable-double-sparsity"]
BODY = {"model": "tiny-llama", "prompt": "abc", "max_tokens": 3, "temperature": 0}
RANK_MESSAGE = r"tensor-parallel rank 1 \(pid {pid}\) exited with code -9"


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (every thread's)."""
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
            for c in (t / "children").read_text().split()]


def rank_process(server_pid: int) -> int:
    """The pid of the server's only tensor-parallel worker (a spawned multiprocessing child; the
    other child is multiprocessing's resource tracker)."""
    ranks = [c for c in children(server_pid)
             if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(ranks) == 1, ranks
    return ranks[0]


def complete(srv: Server) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", headers=AUTH, json=BODY, timeout=10)


def test_killed_rank_ends_the_engine_not_the_server():
    srv = Server(ARGS, timeout=60)
    try:
        assert complete(srv).status_code == 200
        pid = rank_process(srv.proc.pid)
        os.kill(pid, signal.SIGKILL)
        msg = RANK_MESSAGE.format(pid=pid)

        t0 = time.monotonic()
        r = complete(srv)  # the step fails on the closed connection, or on the watchdog's word
        assert r.status_code == 500, r.text
        assert r.json()["error"]["message"].startswith("engine error: ")
        assert re.search(msg, r.json()["error"]["message"]), r.text
        assert time.monotonic() - t0 < 5

        h = httpx.get(srv.url + "/health", timeout=5)
        assert h.status_code == 503 and h.json()["status"] == "engine_dead", h.text
        assert re.search(msg, h.json()["error"]), h.text

        r = complete(srv)  # refused before it reaches the engine, with the same reason
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        assert re.search(msg, r.json()["error"]["message"]), r.text
        for route in ("/v1/models", "/metrics"):  # the process itself still answers
            assert httpx.get(srv.url + route, headers=AUTH, timeout=5).status_code == 200, route
    finally:
        t0 = time.monotonic()
        rc = srv.stop()
    assert rc == 0 and time.monotonic() - t0 < 10
