"""bench_serving against a live server (fake engine: the point is the client, not the model)."""

from __future__ import annotations

import json

import pytest

from doublesparse import bench_serving as B
from test_server import KEY, Server, backend_args


@pytest.fixture(scope="module")
def srv():
    s = Server(backend_args("fake", {"step_delay": 0.002}))
    yield s
    s.stop()


def test_poisson_random_tokens(srv, tmp_path):
    out = tmp_path / "r.json"
    rc = B.main(["--base-url", srv.url, "--api-key", KEY, "--num-prompts", "24",
                 "--request-rate", "60", "--input-len", "16", "--output-len", "6",
                 "--dataset", "random", "--result-json", str(out), "--disable-tqdm"])
    assert rc == 0
    m = json.loads(out.read_text())["metrics"]
    assert m["completed"] == 24 and m["errors"] == 0
    assert m["total_output_tokens"] == 24 * 6  # ignore_eos: exact lengths
    assert m["total_prompt_tokens"] == 24 * 16  # random token ids are sent as-is
    assert m["ttft_ms_p50"] > 0 and m["ttft_ms_p99"] >= m["ttft_ms_p50"]
    assert m["tpot_ms_p50"] > 0 and m["request_throughput"] > 0 and m["output_throughput"] > 0


def test_concurrency_chat_with_malformed_mix(srv):
    args = B.parse_args(["--base-url", srv.url, "--api-key", KEY, "--num-prompts", "30",
                         "--max-concurrency", "4", "--endpoint", "chat", "--input-len", "24",
                         "--output-len", "4", "--malformed-fraction", "0.4", "--disable-tqdm",
                         "--dataset", "shakespeare"])
    m = B.asyncio.run(B.run(args))
    assert m["malformed_sent"] > 0 and m["malformed_unexpected"] == 0
    assert m["malformed_rejected"] == m["malformed_sent"]
    assert m["completed"] == m["valid_requests"] == 30 - m["malformed_sent"]
    assert m["errors"] == 0


def test_errors_are_counted(srv):
    """A wrong key makes every valid request fail: the run reports it and exits non-zero."""
    rc = B.main(["--base-url", srv.url, "--api-key", "wrong", "--model", "fake-model",
                 "--num-prompts", "3", "--output-len", "2", "--input-len", "4", "--disable-tqdm"])
    assert rc == 1


def test_percentiles():
    assert B.pct([], 50) is None
    assert B.pct([3.0, 1.0, 2.0], 50) == 2.0
    assert B.pct([0.0, 10.0], 99) == pytest.approx(9.9)
    rs = [B.Result(ok=True, ttft=0.1, latency=1.1, output_tokens=11),
          B.Result(ok=False, error="boom"), B.Result(ok=True, malformed=True)]
    m = B.summarize(rs, 2.0)
    assert m["completed"] == 1 and m["errors"] == 1 and m["malformed_rejected"] == 1
    assert m["tpot_ms_p50"] == pytest.approx(100.0) and m["request_throughput"] == 0.5
