"""The lm-eval suite's parts that run without lm-eval: the Shakespeare task's data (built from
the evaluation plays, as shipped), its YAMLs, the server-metrics scrape, the suite's summary and
table. lm-eval itself runs in the suite (``python benchmarks/run.py lm-eval``)."""

import importlib.util
import json
from pathlib import Path

import httpx
import pytest

from doublesparse.bench import lmeval, lmeval_data
from server_utils import AUTH, KEY, fake_in_process

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("lm_eval_suite", ROOT / "benchmarks" / "lm_eval_suite.py")
suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite)

PLAY = """HAMLET

ACT I.

[Enter Bernardo.]

Ber.
Who's there? Stand and unfold yourself, I say.
Long live the king, and all his merry men!
Nay, answer me: stand, and unfold yourself.
For this relief much thanks: 'tis bitter cold,
And I am sick at heart, my gentle friend.

Fran.
You come most carefully upon your hour.
[Exit.]
This line comes after a stage direction.
"""


def test_speeches_stop_at_stage_directions():
    sp = lmeval_data.speeches(PLAY)
    assert [w for w, _ in sp] == ["Ber.", "Fran."]
    assert len(sp[0][1]) == 5 and sp[1][1] == ["You come most carefully upon your hour."]


def _plays_available() -> bool:
    try:
        from doublesparse.assets import play_path
        from doublesparse.texts import EVAL_PLAYS
        return all(play_path(p).is_file() for p in EVAL_PLAYS)
    except Exception:
        return False


@pytest.mark.skipif(not _plays_available(), reason="the evaluation plays are not in the cache")
def test_shipped_data_is_what_the_plays_give(tmp_path):
    lmeval_data.write(tmp_path)
    for task in lmeval_data.SIZES:
        shipped = (lmeval_data.TASKS_DIR / f"{task}.jsonl").read_text()
        assert (tmp_path / f"{task}.jsonl").read_text() == shipped, task
    from doublesparse.texts import CALIBRATION_PLAYS
    for line in (lmeval_data.TASKS_DIR / "next_line.jsonl").read_text().splitlines():
        item = json.loads(line)
        assert item["play"] not in CALIBRATION_PLAYS
        assert len(item["choices"]) == 4 and len(set(item["choices"])) == 4
        assert 0 <= item["gold"] < 4 and item["context"].endswith("\n")


def test_task_yamls_name_the_shipped_data():
    yamls = sorted(lmeval_data.TASKS_DIR.glob("*.yaml"))
    assert {p.stem for p in yamls} == set(lmeval.TASKS)
    for p in yamls:
        text = p.read_text()
        fn = text.split("!function shakespeare_utils.")[1].split()[0]
        assert (lmeval_data.TASKS_DIR / f"{fn}.jsonl").is_file()
        assert f"task: {p.stem}" in text
        counts = {t: sum(1 for _ in (lmeval_data.TASKS_DIR / f"{t}.jsonl").open()) for t in lmeval_data.SIZES}
        assert counts == lmeval_data.SIZES


def test_scrape_counts_served_failed_and_refused():
    s = fake_in_process()
    try:
        before = lmeval.scrape(s.url, KEY)
        ok = httpx.post(s.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2}, headers=AUTH)
        bad = httpx.post(s.url + "/v1/completions", json={"prompt": "ab", "max_tokens": -1}, headers=AUTH)
        assert ok.status_code == 200 and bad.status_code == 400
        after = lmeval.scrape(s.url, KEY)
        assert after["served"] - before["served"] == 1 and after["failed"] == before["failed"]
        assert after["refused"] - before["refused"] == 1
        assert after["decode_steps"] > before["decode_steps"] and after["prompt_tokens"] >= 2
    finally:
        s.stop()


def test_lm_eval_command_sends_token_ids_offline(tmp_path):
    cmd = lmeval.lm_eval_command("http://h:1", "m", tmp_path, list(lmeval.TASKS), tmp_path, 5, 1)
    args = cmd[cmd.index("--model_args") + 1]
    assert "base_url=http://h:1/v1/completions" in args and "tokenized_requests=True" in args
    assert f"tokenizer={tmp_path}" in args and cmd[cmd.index("--limit") + 1] == "5"
    assert cmd[cmd.index("--include_path") + 1] == str(lmeval_data.TASKS_DIR)


def _row(scores, sparse=0, errors=0):
    tasks = {"shakespeare_next_line": {"acc,none": scores[0], "acc_norm,none": scores[0]},
             "shakespeare_last_word": {"acc,none": scores[1], "perplexity,none": 80.0},
             "shakespeare_next_word": {"exact_match,first_word": scores[2]}}
    return {"tasks": tasks, "scores": {t: s for t, s in zip(lmeval.TASKS, scores)}, "requests": 100,
            "errors": errors, "decode_steps": 50, "sparse_decode_steps": sparse, "mean_prompt_tokens": 48.0,
            "answers": {"shakespeare_next_word": [1, 0, 0] if sparse else [1, 1, 0]},
            "generations": {"shakespeare_next_word": [" a b", " c d", " e"] if sparse else [" a b", " c", " e"]}}


def test_suite_summary_and_table():
    rows = {"dense": _row([0.5, 0.3, 0.2]), "ds": _row([0.5, 0.3, 0.2]), "ds-sparse": _row([None, None, 0.1], 50)}
    s = suite.summary(rows)
    assert s["dense_acc"] == s["ds_acc"] == 0.5 and s["max_abs_diff_points"] == 0
    assert s["requests"] == 300 and s["errors"] == 0
    assert s["samples_differing_dense_vs_ds_sparse"] == {"shakespeare_next_word": 1}
    assert s["generations_differing_dense_vs_ds_sparse"] == {"shakespeare_next_word": 1}
    assert s["generations_differing_dense_vs_ds"] == {"shakespeare_next_word": 0}
    table = suite.table(rows)
    assert table[2].startswith("| dense | 0.500 | 0.500 | 0.300 | 80.0 | 0.200 | 100 | 48.0 | 0 | 0/50 |")
    failed = suite.summary({"dense": {"error": "lm-eval exit 1", "requests": 3, "errors": 1}})
    assert failed["errors"] == 1 and failed["dense_acc"] is None
