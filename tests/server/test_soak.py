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

CLIENTS, REQUESTS, SEED = 6, 4, 16  # requests per client; `benchmarks/run.py soak` runs 30 minutes


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
        assert rc == 0 and s.health()["status"] == "ok"
    finally:
        assert s.stop() == 0  # drained cleanly
