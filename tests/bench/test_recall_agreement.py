"""bench.recall_agreement end to end on the tiny random Llama (CPU): the probe's samples and the
offline eval's attention mass on the same windows, the summary's keys (the `recall` suite reads
them)."""

import json

import pytest

from doublesparse.bench import recall_agreement

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bench_recall_agreement_tiny(tmp_path):
    out = tmp_path / "r.json"
    assert recall_agreement.main(["--tiny", "--device", "cpu", "--window-len", "512", "--decode-len", "24",
                                  "--num-windows", "2", "--ds-heavy-token-min", "32",
                                  "--result-json", str(out)]) == 0
    res = json.loads(out.read_text())
    s = res["summary"]
    assert res["engine_k"] == [32] and res["k"] == 32 and s["one_k"]   # the eval's driver has one k
    assert s["online_samples"] == 2 * 23 == s["offline_tokens"]   # every step samples both windows
    assert sum(x["samples"] for x in res["layers"]) == s["online_samples"]
    # the same tokens measured both ways: the probe's recall is the eval's attention mass
    assert s["matched_abs"] < 1e-5
    assert s["recall_agreement_abs"] == pytest.approx(abs(s["online_recall"] - s["offline_recall"]))
    # the eval's recall divides by the true top-k's mass: a different, larger figure
    assert s["offline_recall_topk"] > s["offline_recall"]
