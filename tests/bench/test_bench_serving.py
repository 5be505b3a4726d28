"""bench_serving against a live server (fake engine: the point is the client, not the model)."""

from __future__ import annotations

import json

import pytest

from doublesparse.bench import serving as B
from doublesparse.bench import serving_workload as W
from server_utils import KEY, fake_in_process


@pytest.fixture(scope="module")
def srv():
    s = fake_in_process({"step_delay": 0.002})
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


def test_generate_endpoint_counts_tokens_without_text(srv, tmp_path):
    """/generate streams cumulative completion_tokens, so TTFT/TPOT/ITL need no tokenizer (dummy
    weights stream no text); lengths are exact under ignore_eos; the server's counters ride along."""
    out = tmp_path / "g.json"
    rc = B.main(["--base-url", srv.url, "--api-key", KEY, "--endpoint", "generate",
                 "--num-prompts", "8", "--max-concurrency", "4", "--input-len", "32",
                 "--output-len", "12", "--warmup-requests", "2", "--result-json", str(out),
                 "--disable-tqdm"])
    assert rc == 0
    doc = json.loads(out.read_text())
    m = doc["metrics"]
    assert doc["partial"] is False
    assert m["completed"] == 8 and m["errors"] == 0 and m["output_len_mismatch"] == 0
    assert m["total_output_tokens"] == 8 * 12 and m["total_prompt_tokens"] == 8 * 32
    assert 0 < m["itl_ms_p50"] <= m["itl_ms_p90"] <= m["itl_ms_p99"]
    assert 0 < m["tpot_ms_p50"] <= m["tpot_ms_p99"] and m["ttft_ms_p50"] > 0
    c = m["server_counters"]  # the measured run only: warm-up came before the first scrape
    assert c["generation_tokens"] == 8 * 12 and c["decode_steps"] > 0
    assert 0 <= c["sparse_decode_steps"] <= c["decode_steps"]


def test_generate_malformed_mix_is_exact(srv):
    """10% of 20 is exactly 2 malformed requests, each refused with a 4xx; no valid one is lost."""
    args = B.parse_args(["--base-url", srv.url, "--api-key", KEY, "--endpoint", "generate",
                         "--num-prompts", "20", "--max-concurrency", "5", "--input-len", "8",
                         "--output-len", "3", "--malformed-fraction", "0.1", "--disable-tqdm"])
    m = B.asyncio.run(B.run(args))
    assert m["malformed_sent"] == 2 and m["malformed_rejected"] == 2
    assert m["completed"] == m["valid_requests"] == 18 and m["errors"] == 0


@pytest.mark.parametrize("endpoint", ["generate", "completions", "chat"])
def test_every_malformed_kind_is_refused(srv, endpoint):
    base = W._body(B.parse_args(["--endpoint", endpoint]), "fake-model", B.random.Random(0),
                   [], 8, 2)
    kinds = set()
    for seed in range(60):  # every kind of this endpoint comes up among 60 draws
        spec = W._malformed(B.random.Random(seed), base, endpoint)
        if spec.malformed_kind in kinds:
            continue
        kinds.add(spec.malformed_kind)
        r = B.httpx.post(srv.url + B.PATHS[endpoint], content=spec.raw, timeout=10,
                         headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        assert 400 <= r.status_code < 500 and "error" in r.json(), (spec.malformed_kind, r.text)
    assert len(kinds) >= 6


def test_deadline_cuts_the_run_and_the_server_frees_it(srv, tmp_path, capsys):
    """Past --deadline nothing more is sent and in-flight streams are cancelled: they count as cut,
    not as failures, their streamed tokens still count, and the server aborts them."""
    out = tmp_path / "d.json"
    rc = B.main(["--base-url", srv.url, "--api-key", KEY, "--endpoint", "generate",
                 "--num-prompts", "10", "--max-concurrency", "2", "--input-len", "16",
                 "--output-len", "900", "--deadline", "0.5", "--progress-interval", "0.2",
                 "--result-json", str(out), "--disable-tqdm"])
    assert rc == 0
    m = json.loads(out.read_text())["metrics"]
    assert m["cancelled_in_flight"] == 2 and m["not_sent"] == 8 and m["errors"] == 0
    assert m["completed"] == 0 and m["total_output_tokens_incl_cut"] > 0
    assert m["output_throughput_incl_cut"] > 0 and m["duration_s"] < 2.0
    printed = capsys.readouterr().out
    assert "deadline of 0 s reached" in printed and "done 0/10" in printed  # progress lines
    srv.wait_idle()


def test_summary_of_cut_and_pending_requests():
    done = B.Result(ok=True, ttft=0.1, latency=0.5, output_tokens=5, itl=[0.1, 0.1, 0.1, 0.1])
    pending = B.Result()  # not answered yet: neither an error nor done (progress reports)
    cut = B.Result(cancelled=True, output_tokens=7)
    never = B.Result(not_sent=True)
    m = B.summarize([done, pending, cut, never], 1.0, output_len=5)
    assert m["completed"] == 1 and m["errors"] == 0
    assert m["cancelled_in_flight"] == 1 and m["not_sent"] == 1
    assert m["total_output_tokens"] == 5 and m["total_output_tokens_incl_cut"] == 12
    assert m["output_len_mismatch"] == 0 and m["itl_ms_p50"] == pytest.approx(100.0)
    assert m["tpot_ms_mean"] == pytest.approx(100.0)
    assert B.counter_deltas({"doublesparse_decode_steps_total": 3.0},
                            {"doublesparse_decode_steps_total": 10.0,
                             "doublesparse_kv_pool_usage": 0.5}) == {"decode_steps": 7.0}
    assert B.counter_deltas(None, {}) is None


def test_serving_suite_summary(srv, tmp_path):
    """The benchmark driver's serving summary from real bench_serving output (against the fake
    server, at toy sizes): DS over dense, failures, and the malformed mix's lost valid requests."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"
    spec = importlib.util.spec_from_file_location("bench_run", path)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    common = ["--base-url", srv.url, "--api-key", KEY, "--endpoint", "generate", "--input-len", "16",
              "--max-concurrency", "2", "--disable-tqdm"]
    rows = {}
    for name, extra in (("dense", ["--num-prompts", "4", "--output-len", "8"]),
                        ("ds", ["--num-prompts", "4", "--output-len", "8"]),
                        ("malformed-generate", ["--num-prompts", "10", "--output-len", "2",
                                                "--malformed-fraction", "0.1"])):
        out = tmp_path / f"{name}.json"
        assert B.main(common + extra + ["--result-json", str(out)]) == 0
        rows[name] = json.loads(out.read_text())
    s = run.summarize("serving", rows)
    assert "error" not in s, s
    assert s["failed_requests"] == 0 and s["malformed_run_valid_lost"] == 0
    assert s["ds_over_dense_output_tok_s"] > 0 and s["ds_over_dense_tpot_p50"] > 0
