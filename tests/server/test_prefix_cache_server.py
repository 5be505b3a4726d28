"""The prefix cache through the server (tiny random Llama, CPU): its /metrics hit counters,
/flush_cache, and bench_serving's generated-shared-prefix workload with its hit rate."""

from __future__ import annotations

import json

import httpx
import pytest
from server_utils import AUTH, KEY, InProcessServer

from doublesparse.bench import serving as B
from doublesparse.server.app import create_app
from doublesparse.server.config import ServerConfig
from doublesparse.server.fake_engine import tiny_engine


@pytest.fixture(scope="module")
def srv():
    engine = tiny_engine(device="cpu", max_total_tokens=3000, context_length=1024, chunked_prefill_size=64)
    s = InProcessServer(create_app(engine, ServerConfig(api_key=KEY)))
    yield s
    s.stop()


def generate(srv, ids, n=4):
    body = {
        "input_ids": ids,
        "sampling_params": {
            "max_new_tokens": n,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    }
    r = httpx.post(srv.url + "/generate", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_metrics_count_hits_and_flush_empties_the_pool(srv):
    doc = list(range(40, 140))
    hit0, q0 = (
        srv.metric("doublesparse_prefix_cache_hit_tokens_total"),
        srv.metric("doublesparse_prefix_cache_query_tokens_total"),
    )
    a = generate(srv, doc + [5, 6, 7])
    b = generate(
        srv, doc + [5, 6, 7]
    )  # the same prompt again: same greedy tokens, from the cache
    assert a["text"] == b["text"]
    srv.wait_idle()
    hit = srv.metric("doublesparse_prefix_cache_hit_tokens_total") - hit0
    query = srv.metric("doublesparse_prefix_cache_query_tokens_total") - q0
    assert query == 2 * 103 and hit == 102
    assert 0 < srv.metric("doublesparse_prefix_cache_hit_rate") <= 1
    assert srv.metric("doublesparse_kv_pool_cached_tokens") > 0
    r = httpx.post(srv.url + "/flush_cache", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["flushed_tokens"] > 0
    assert srv.metric("doublesparse_kv_pool_cached_tokens") == 0
    assert srv.health()["kv_used_tokens"] == 0


def test_bench_serving_shared_prefix_reports_hit_rate(srv, tmp_path):
    out = tmp_path / "gsp.json"
    rc = B.main(
        [
            "--base-url",
            srv.url,
            "--api-key",
            KEY,
            "--endpoint",
            "generate",
            "--dataset-name",
            "generated-shared-prefix",
            "--gsp-num-groups",
            "3",
            "--gsp-prompts-per-group",
            "4",
            "--gsp-system-prompt-len",
            "150",
            "--gsp-question-len",
            "7",
            "--gsp-output-len",
            "3",
            "--max-concurrency",
            "4",
            "--random-token-low",
            "1",
            "--random-token-high",
            "250",
            "--result-json",
            str(out),
            "--disable-tqdm",
        ]
    )
    assert rc == 0
    m = json.loads(out.read_text())["metrics"]
    assert (
        m["completed"] == 12
        and m["total_prompt_tokens"] == 12 * 157
        and m["output_len_mismatch"] == 0
    )
    # at least the 9 requests after each group's first could reuse their group's prefix
    assert 0.3 < m["prefix_cache_hit_rate"] < 1
    assert (
        m["ttft_cold_ms_p50"] > 0
        and m["ttft_warm_ms_p50"] > 0
        and m["ttft_warm_over_cold_p50"] > 0
    )
