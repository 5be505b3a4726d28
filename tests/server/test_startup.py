"""``serve`` from start to ready: the port answers while the model loads (server/loading.py), the
startup line reports the decode mode the engine reports, and a failed load ends the command with
its error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx

from server_utils import AUTH, FAKE, KEY, free_port


def _launch(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "doublesparse.launch_server", "--port", str(port),
           "--api-key", KEY, "--log-level", "info", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, f"http://127.0.0.1:{port}"


def _first_answer(proc, url: str, timeout: float = 60.0) -> httpx.Response:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            return httpx.get(url + "/health", timeout=1)
        except httpx.HTTPError:
            time.sleep(0.05)
    raise AssertionError("the server never answered")


def _wait_status(url: str, status: int, timeout: float = 60.0) -> httpx.Response:
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = httpx.get(url + "/health", timeout=2)
        if r.status_code == status:
            return r
        time.sleep(0.1)
    raise AssertionError(f"/health never answered {status}")


def test_health_answers_loading_until_the_engine_is_built():
    kw = {"load_delay": 4.0, "step_delay": 0.001}
    proc, url = _launch(["--engine-factory", FAKE, "--engine-kwargs", json.dumps(kw)])
    try:
        r = _first_answer(proc, url)
        assert r.status_code == 503 and r.json()["status"] == "loading", r.text
        assert r.headers["retry-after"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers=AUTH, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        assert _wait_status(url, 200).json()["status"] == "ok"
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers=AUTH, timeout=10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert "answers 503 'loading'" in out
    # the fake engine's stats carry no decode mode: the line does not invent one
    assert "serving fake-model on" in out and "decode: mode not reported by the engine" in out


def test_a_failed_load_ends_the_command_with_its_error():
    kw = {"load_delay": 1.0, "load_error": "no such weights here"}
    proc, url = _launch(["--engine-factory", FAKE, "--engine-kwargs", json.dumps(kw)])
    try:
        r = _first_answer(proc, url)
        assert r.status_code == 503 and r.json()["status"] in ("loading", "failed")
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.stdout.read()
    assert proc.returncode == 2 and "error: no such weights here" in out, out


def test_sigterm_while_loading_stops_at_once():
    proc, url = _launch(["--engine-factory", FAKE, "--engine-kwargs",
                         json.dumps({"load_delay": 120.0})])
    try:
        assert _first_answer(proc, url).json()["status"] == "loading"
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        assert time.time() - t0 < 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_startup_line_reports_double_sparsity_as_health_does():
    """The line is written once the engine thread has started, from the same stats as /health
    (it used to read them before, and said "dense (Double Sparsity off)" for every engine)."""
    proc, url = _launch(["--engine-factory", "doublesparse.server.fake_engine:tiny_engine",
                         "--enable-double-sparsity", "--max-total-tokens", "4096"])
    try:
        _first_answer(proc, url, timeout=120)
        health = _wait_status(url, 200, timeout=120).json()
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert health["decode"]["double_sparsity"] is True
    (line,) = [ln for ln in out.splitlines() if "serving tiny-llama on" in ln]
    assert "decode: Double Sparsity" in line and "Double Sparsity off" not in line, line
    assert f"r={health['decode']['heavy_channel_num']} " in line
    assert health["decode"]["operating_point"] and health["decode"]["operating_point"] in line
