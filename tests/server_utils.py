"""Servers on 127.0.0.1 for the HTTP tests (server and serving benchmark): a real server process
(:class:`Server`), or the app under uvicorn in a thread of the test process (:class:`InProcessServer`).

Tests run in parallel (pytest-xdist), so no port is fixed: the in-process server listens on a
socket bound to port 0 before it starts, and a server process that loses the race for the free
port it was given is started again on another.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from doublesparse.engine.engine import Engine as RealEngine  # noqa: F401  (re-exported)

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
FAKE = "doublesparse.server.fake_engine:FakeEngine"
FAKE_KW = {"step_delay": 0.003, "max_context_len": 1024}

REAL_KW = {"device": "cpu", "max_total_tokens": 8192, "context_length": 2048}
REAL_ARGS = [a for k, v in REAL_KW.items() for a in ("--" + k.replace("_", "-"), str(v))]


class _PortTaken(RuntimeError):
    """Another process took the port between :func:`free_port` and the server's bind."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: list[str], timeout: float = 240.0, attempts: int = 3) -> None:
        for attempt in range(attempts):
            try:
                self._start(args, timeout)
                return
            except _PortTaken:
                if attempt == attempts - 1:
                    raise RuntimeError("no free port after %d attempts" % attempts) from None

    def _start(self, args: list[str], timeout: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "doublesparse.launch_server", "--port", str(self.port),
               "--api-key", KEY, "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read()
                if "already in use" in out.lower():  # the preflight check's or uvicorn's bind error
                    raise _PortTaken(out)
                raise RuntimeError(f"server exited early:\n{out}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            h = self.health()
            if h["running"] == 0 and h["waiting"] == 0 and h["kv_used_tokens"] == 0 \
                    and h["in_flight"] == 0:
                return h
            time.sleep(0.1)
        raise AssertionError(f"server not idle: {self.health()}")

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(self.url + "/metrics", headers=AUTH, timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + (labels and "{")) or line.startswith(name + " "):
                if labels in line:
                    total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def fake_in_process(extra: dict | None = None, **config) -> "InProcessServer":
    """The fake engine's server in this process: what ``Server(backend_args("fake", extra))``
    serves, without a process that imports torch again. ``config``: ServerConfig fields."""
    from doublesparse.server.app import create_app
    from doublesparse.server.config import ServerConfig
    from doublesparse.server.fake_engine import FakeEngine

    engine = FakeEngine(**{**FAKE_KW, "max_total_tokens": 8192, **(extra or {})})
    return InProcessServer(create_app(engine, ServerConfig(api_key=KEY, **config)))


def backend_args(kind: str, extra: dict | None = None) -> list[str]:
    if kind == "fake":
        return ["--engine-factory", FAKE, "--engine-kwargs", json.dumps({**FAKE_KW, **(extra or {})}),
                "--max-total-tokens", str((extra or {}).get("max_total_tokens", 8192))]
    return REAL_ARGS


class InProcessServer:
    """``app`` under uvicorn in a daemon thread of this process, on a socket bound to a free
    port before the server starts (no window for another process to take it). The modules are
    loaded already, so it starts at once; :class:`Server`'s health helpers work on it."""

    def __init__(self, app, timeout: float = 60.0) -> None:
        import uvicorn

        self.app = app
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.time() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError("in-process server did not start")
            time.sleep(0.02)

    health, wait_idle, metric = Server.health, Server.wait_idle, Server.metric

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
