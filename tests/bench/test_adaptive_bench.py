"""bench.adaptive end to end on the tiny random Llama (CPU): three budgets on the same windows,
the summary's keys (the GPU suite `python benchmarks/run.py adaptive` reads them)."""

import json

import pytest

from doublesparse.bench import adaptive

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bench_adaptive_tiny(tmp_path):
    out = tmp_path / "r.json"
    assert adaptive.main(["--tiny", "--device", "cpu", "--window-len", "512", "--decode-len", "24",
                          "--num-windows", "2", "--warmup-windows", "1", "--ds-heavy-token-min", "16",
                          "--ds-sparse-decode-threshold", "0", "--result-json", str(out)]) == 0
    res = json.loads(out.read_text())
    b, s = res["budgets"], res["summary"]
    assert set(b) == {"dense", "ratio", "adaptive", "ratio_matched"}
    assert all(r["tokens"] == 2 * 23 for r in b.values())
    assert b["ratio"]["decode_bytes"] < b["dense"]["decode_bytes"]
    assert s["adaptive_bytes_saving_pct"] == pytest.approx(
        100 * (1 - b["adaptive"]["decode_bytes"] / b["ratio"]["decode_bytes"]))
    assert len(s["adaptive_scales"]) == 2 and "warmup" in b["adaptive"]
    assert b["adaptive"]["heavy_token_num"] == 2 * b["ratio"]["heavy_token_num"]
    # the peer at the adaptive run's bytes: its ratio and floor scaled by one factor, bytes close
    m, r = b["ratio_matched"]["budget"], b["ratio"]["budget"]
    assert m["ratio"] / r["ratio"] == pytest.approx(m["k_min"] / r["k_min"], rel=0.1)
    assert b["ratio_matched"]["decode_bytes"] == pytest.approx(b["adaptive"]["decode_bytes"], rel=0.1)
    assert set(s["ppl_increase_pct"]) == {"ratio", "adaptive", "ratio_matched"}
