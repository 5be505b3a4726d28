"""No request can steal another's work or outlive its client (fake engine, in this process):
fan-out aborted on disconnect from acceptance, bounds on choices per request and per client,
fair admission of a newcomer behind a large fan-out, server-owned request ids, 5xx logged with
their id, and graceful shutdown cutting streams with a last event at its deadline."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time

import httpx
import pytest

from server_utils import AUTH, Server, backend_args, fake_in_process

LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def srv():
    # 4 running at most, so a fan-out is mostly still queued when its client leaves
    s = fake_in_process({"max_running_requests": 4, "step_delay": 0.004},
                        max_choices_per_request=200, max_requests_per_client=300)
    yield s
    s.stop()


def _disconnected(s) -> float:
    return s.metric("doublesparse_requests_total", 'status="disconnected"')


@pytest.mark.parametrize("stream", [False, True])
def test_fanout_aborted_when_its_client_leaves(srv, stream):
    srv.wait_idle()
    before = _disconnected(srv)
    body = {"prompt": [f"p{i}" for i in range(8)], "n": 16, "stream": stream, **LONG}
    if stream:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=AUTH,
                          timeout=30) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # headers and a first chunk, then the client leaves
    else:
        with pytest.raises(httpx.ReadTimeout):  # gives up long before any sibling has a token
            httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH, timeout=0.3)
    h = srv.wait_idle(timeout=20)  # 128 siblings x 400 tokens would take minutes
    assert h["kv_used_tokens"] == 0
    assert _disconnected(srv) - before == 128


def test_newcomer_is_served_beside_a_fanout(srv):
    """A normal request sent while 128 siblings of another are queued runs at once (the last
    running slot is kept for it) and completes while the fan-out still runs."""
    srv.wait_idle()
    body = {"prompt": [f"q{i}" for i in range(8)], "n": 16, **LONG}
    out: dict = {}

    def fan():
        try:
            httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH, timeout=3)
        except httpx.ReadTimeout:
            out["fanout"] = "left"

    t = threading.Thread(target=fan)
    t.start()
    deadline = time.time() + 10
    while srv.health()["waiting"] < 100 and time.time() < deadline:
        time.sleep(0.02)
    r = httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=30,
                   json={"prompt": "solo", "max_tokens": 20, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
    assert srv.health()["waiting"] > 0  # the fan-out was still queued: it did not go first
    t.join(30)
    assert out.get("fanout") == "left"
    srv.wait_idle(timeout=20)


def test_choice_and_client_bounds(srv):
    srv.wait_idle()
    r = httpx.post(srv.url + "/v1/completions", headers=AUTH,
                   json={"prompt": ["a"] * 3, "n": 100, "max_tokens": 2})
    e = r.json()["error"]
    assert r.status_code == 400 and e["param"] == "n" and e["code"] == "too_many_choices"
    r = httpx.post(srv.url + "/v1/completions", headers=AUTH,
                   json={"prompt": ["a"] * 2, "n": 2, "best_of": 128, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    r = httpx.post(srv.url + "/v1/chat/completions", headers=AUTH,
                   json={"messages": [{"role": "user", "content": "x"}], "n": 128, "max_tokens": 2})
    assert r.status_code == 200  # 128 <= 200

    async def two():
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=60) as c:
            big = {"prompt": ["b"] * 10, "n": 20, **LONG}            # 200 of the 300 allowed
            first = asyncio.create_task(c.post("/v1/completions", json=big))
            while (await c.get("/health")).json()["in_flight"] < 200:
                await asyncio.sleep(0.01)
            second = await c.post("/v1/completions", json=big)     # 400 > 300: refused
            small = await c.post("/v1/completions", json={"prompt": "s", "max_tokens": 2})
            first.cancel()
            return second, small

    second, small = asyncio.run(two())
    assert second.status_code == 429 and second.headers["retry-after"] == "1"
    assert second.json()["error"]["code"] == "rate_limit_exceeded"
    assert small.status_code == 200  # the client still had room for one more
    srv.wait_idle(timeout=20)
    assert srv.app.state.server.admission.load == {}  # every share given back


def test_rid_is_scoped_and_duplicates_leave_the_original_alone(srv):
    srv.wait_idle()
    body = {"text": "mine", "rid": "job-1", "stream": True,
            "sampling_params": {"max_new_tokens": 64, "ignore_eos": True, "temperature": 0}}
    events = []
    with httpx.stream("POST", srv.url + "/generate", json=body, headers=AUTH, timeout=30) as r:
        lines = r.iter_lines()
        events.append(next(lines))
        for stream in (True, False):  # a second client reuses the running rid, then hangs up
            dup = httpx.post(srv.url + "/generate", headers=AUTH, timeout=5,
                             json={**body, "stream": stream, "text": "theirs"})
            assert dup.status_code == 400
            assert dup.json()["error"]["param"] == "rid"
            assert dup.json()["error"]["code"] == "duplicate_rid"
        events.extend(lines)
    data = [json.loads(ln[6:]) for ln in events if ln.startswith("data: {")]
    assert data[-1]["meta_info"]["completion_tokens"] == 64
    assert data[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    assert data[-1]["meta_info"]["id"] == "job-1"  # the client's label, not the engine's id
    # finished: the rid is free again
    r = httpx.post(srv.url + "/generate", headers=AUTH, json={**body, "stream": False})
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "job-1"


def test_5xx_logged_with_request_id(caplog):
    s = fake_in_process({"fail_marker": "BOOM"})
    try:
        with caplog.at_level(logging.ERROR, logger="doublesparse.server"):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "BOOM", "max_tokens": 3},
                           headers=AUTH, timeout=30)
        assert r.status_code == 500
        rid = r.headers["x-request-id"]
        assert rid.startswith("cmpl-")
        assert any(rid in rec.getMessage() and "500" in rec.getMessage() for rec in caplog.records)
    finally:
        s.stop()


def test_graceful_shutdown_cuts_streams_at_the_deadline():
    """--graceful-shutdown-timeout 1 with streams of ~4 s: each ends with an error event
    (code "shutdown") and [DONE], and the server exits cleanly, without a traceback."""
    s = Server(backend_args("fake", {"step_delay": 0.004}) + ["--graceful-shutdown-timeout", "1"])
    got: dict[int, list[str]] = {}

    def stream(i):
        body = {"prompt": f"s{i}", "max_tokens": 1000, "ignore_eos": True, "stream": True,
                "n": 1 + i}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, headers=AUTH,
                          timeout=30) as r:
            got[i] = [ln for ln in r.iter_lines() if ln.startswith("data: ")]

    ts = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    while s.health()["running"] < 3:
        time.sleep(0.02)
    s.proc.send_signal(signal.SIGTERM)
    for t in ts:
        t.join(20)
    assert s.proc.wait(20) == 0
    for lines in got.values():
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == "shutdown"
    log = s.proc.stdout.read()
    assert "Traceback" not in log, log


@pytest.mark.parametrize("stream", [False, True])
def test_fanout_runs_through_its_window(srv, stream):
    """A fan-out larger than its window: at most the prompts' first siblings plus ``window``
    others are in the engine at once, and every choice still ends with all its tokens."""
    st = srv.app.state.server
    srv.wait_idle()
    saved, st.fanout_window = st.fanout_window, 6
    peak = {"n": 0}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            h = srv.health()
            peak["n"] = max(peak["n"], h["waiting"] + h["running"])
            time.sleep(0.005)

    t = threading.Thread(target=watch)
    t.start()
    try:
        body = {"prompt": ["a", "b", "c"], "n": 13, "max_tokens": 7, "ignore_eos": True,
                "temperature": 0, "stream": stream}
        if stream:
            ends: dict = {}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=AUTH,
                              timeout=60) as r:
                for ln in r.iter_lines():
                    if ln.startswith("data: {"):
                        for c in json.loads(ln[6:])["choices"]:
                            if c["finish_reason"]:
                                ends[c["index"]] = c["finish_reason"]
            assert ends == {i: "length" for i in range(39)}
        else:
            r = httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
            got = r.json()["choices"]
            assert sorted(c["index"] for c in got) == list(range(39))
            assert all(c["finish_reason"] == "length" for c in got)
            assert r.json()["usage"]["completion_tokens"] == 39 * 7
    finally:
        stop.set()
        t.join()
        st.fanout_window = saved
    assert 0 < peak["n"] <= 3 + 6
    srv.wait_idle()


def test_fanout_window_left_behind_when_its_client_leaves(srv):
    """Siblings never submitted are dropped with the rest when the client leaves."""
    st = srv.app.state.server
    srv.wait_idle()
    saved, st.fanout_window = st.fanout_window, 5
    before = _disconnected(srv)
    try:
        body = {"prompt": ["x", "y"], "n": 60, **LONG}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH, timeout=0.3)
        h = srv.wait_idle(timeout=20)
    finally:
        st.fanout_window = saved
    assert h["kv_used_tokens"] == 0
    assert 0 < _disconnected(srv) - before <= 2 + 5  # only the submitted ones reached the engine
