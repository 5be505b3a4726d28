"""A short soak of the real CPU server (embedded SmolLM2): a mixed load of valid, streamed,
oversize, malformed (out-of-bounds sampling parameters too), dropped, duplicate and KV-filling
requests, fanned-out requests whose client hangs up, and rid collisions, loses nothing (the suite's
``soak`` runs it for a fixed time, longer, and on a GPU).

The test sends a fixed number of requests per client rather than loading the server for a fixed
time: each client's mix is drawn from the seed, so every kind is sent however fast the machine is
(seed 16 gives 24 requests: 2 duplicates, one burst, one fan-out, one rid collision, and each
other kind at least once; ``soak.kind_sequence`` draws them)."""

from doublesparse.bench import soak
from server_utils import KEY, Server, backend_args

CLIENTS, REQUESTS, SEED = 6, 4, 16  # requests per client; `benchmarks/run.py soak` runs 8 minutes


def test_soak_loses_nothing(tmp_path):
    s = Server(backend_args("real"))
    try:
        out = tmp_path / "soak.json"
        rc = soak.main(["--base-url", s.url, "--api-key", KEY, "--requests", str(REQUESTS), "--seed", str(SEED),
                        "--concurrency", str(CLIENTS), "--server-pid", str(s.proc.pid), "--oversize-words", "3000",
                        "--burst-words", "700", "--burst-size", "4", "--result-json", str(out)])
        import json
        res = json.loads(out.read_text())
        assert res["lost_valid"] == 0, res["lost_examples"]
        assert res["http_5xx"] == 0 and not res["wrong_refusals"]
        assert res["duplicates"] >= 2 and res["duplicates_identical"] == 1
        assert res["fanout_disconnects"] >= 1  # and its siblings all ended (metrics_consistent)
        assert res["rid_collisions"] >= 1 and res["rid_collisions_intact"] == res["rid_collisions"]
        assert res["metrics_consistent"] == 1, (res["server_ended"], res["client_expected"])
        assert sum(res["sent"].values()) == CLIENTS * REQUESTS
        assert all(res["sent"].get(k, 0) > 0 for k in soak.KINDS), res["sent"]
        assert res["rss_mb_series"] and all(mb > 0 for _, mb in res["rss_mb_series"])
        # the fake engine runs no Triton kernel; the gauge is there (0) wherever triton imports
        assert all(g.get("triton_kernels_compiled", 0) >= 0 for _, g in res["runtime_series"])
        assert rc == 0 and s.health()["status"] == "ok"
    finally:
        assert s.stop() == 0  # drained cleanly


def test_rss_series_thinned():
    samples = [(0.5 * i, (100 + i) * 2**20) for i in range(200)]  # 2 Hz for 100 s
    series = soak._every(samples, 30.0)
    assert [t for t, _ in series] == [0.0, 30.0, 60.0, 90.0, 99.5] and series[-1][1] == 299.0
    assert soak._every([], 30.0) == []


def test_rss_growth_ignores_bursts_and_sees_a_rising_floor():
    from doublesparse.bench.soak import rss_growth_pct
    flat = [(s, 1000 + (400 if s % 37 == 0 else 0)) for s in range(0, 481)]  # bursts come and go
    assert rss_growth_pct(flat, 480) == 0
    # a burst at the very end does not count as growth; a floor rising 10 % does
    assert rss_growth_pct(flat[:-1] + [(480, 1800)], 480) == 0
    leak = [(s, 1000 + s // 2) for s in range(0, 481)]
    assert abs(rss_growth_pct(leak, 480) - 100 * (1210 / 1120 - 1)) < 1e-9  # floors at 240 s and 420 s
    assert rss_growth_pct([(300, 5)], 480) is None
