"""A real server process on 127.0.0.1 for the HTTP tests (server and serving benchmark)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from doublesparse.engine.engine import Engine as RealEngine  # noqa: F401  (re-exported)

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
FAKE = "doublesparse.server.fake_engine:FakeEngine"
FAKE_KW = {"step_delay": 0.003, "max_context_len": 1024}

REAL_KW = {"device": "cpu", "max_total_tokens": 8192, "context_length": 2048}
REAL_ARGS = [a for k, v in REAL_KW.items() for a in ("--" + k.replace("_", "-"), str(v))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: list[str], timeout: float = 240.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "doublesparse.launch_server", "--port", str(self.port),
               "--api-key", KEY, "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.proc.stdout.read()}")
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


def backend_args(kind: str, extra: dict | None = None) -> list[str]:
    if kind == "fake":
        return ["--engine-factory", FAKE, "--engine-kwargs", json.dumps({**FAKE_KW, **(extra or {})}),
                "--max-total-tokens", str((extra or {}).get("max_total_tokens", 8192))]
    return REAL_ARGS
