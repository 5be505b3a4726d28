"""RULER-style tasks (deterministic prompts of the asked length, answers where they must be, the
scorer) and the long-context protocol end to end on the tiny model."""

import json
from collections import Counter

import pytest

from doublesparse.eval import long_context, long_report, ruler
from doublesparse.testing import ByteTokenizer


@pytest.fixture(scope="module")
def lines():
    return ruler.haystack_lines()


@pytest.mark.parametrize("n", [777, 1501])
def test_samples_are_deterministic_and_sized(lines, n):
    tok = ByteTokenizer()
    vocab = ruler.vocabulary(lines)
    for task in ruler.TASKS:
        a = ruler.make_sample(tok, task, n, 3, 7, lines, vocab)
        b = ruler.make_sample(tok, task, n, 3, 7, lines, vocab)
        assert a == b and a.ids == b.ids  # same seed, same prompt
        assert ruler.make_sample(tok, task, n, 4, 7, lines, vocab).answers != a.answers
        assert 0.93 * n <= len(a.ids) <= n, (task, len(a.ids))
        text = tok.decode(list(a.ids))
        if task.startswith("niah"):  # every expected number is in the text exactly once
            assert all(text.count(x) == 1 for x in a.answers)
            assert len(a.answers) == (
                ruler.NUM_VALUES if task == "niah_multivalue" else 1
            )
        elif task == "vt":  # the chain in order, each variable defined once
            pos = [text.index(f"VAR {v} =") for v in a.answers]
            assert pos == sorted(pos) and all(
                text.count(f"VAR {v} =") == 1 for v in a.answers
            )
        else:  # cwe: the asked words are the most frequent entries of the list
            entries = Counter(
                ln.split(". ", 1)[1]
                for ln in text.splitlines()
                if ". " in ln and ln[0].isdigit()
            )
            top = {w for w, _ in entries.most_common(ruler.NUM_COMMON)}
            assert top == set(a.answers) and min(entries[w] for w in top) > max(
                c for w, c in entries.items() if w not in top
            )


def test_score():
    assert ruler.score(
        "The numbers are 1234567, 7654321.", ("1234567", "7654321", "1111111")
    ) == pytest.approx(2 / 3)
    assert ruler.score(" ABCDE and fghij", ("abcde", "FGHIJ")) == 1.0
    assert ruler.score("", ("x",)) == 0.0


def test_summary_default_vs_dense():
    res = {
        "default_setting": "d",
        "text": {
            "16384": {
                "dense": {"ppl": 10.0, "bytes_per_step": 100},
                "d": {"ppl": 10.2, "bytes_per_step": 20},
            }
        },
        "ruler": {
            "16384": {
                "dense": {"vt": 100.0, "cwe": 80.0},
                "d": {"vt": 90.0, "cwe": 82.0},
            }
        },
    }
    s = long_report.summary(res)
    assert (
        s["ppl_increase_pct_16384"] == pytest.approx(2.0)
        and s["bytes_fraction_16384"] == 0.2
    )
    assert s["ruler_max_drop_pts"] == pytest.approx(10.0)


def test_long_context_end_to_end(tmp_path):
    out = tmp_path / "lc"
    argv = ["--tiny", "--device", "cpu", "-o", str(out), "--lengths", "600", "--num-windows", "1",
            "--decode-len", "6", "--samples-per-task", "1", "--max-new-tokens", "3", "--quiet",
            "--settings", "dense", "default", "group_sum"]  # fmt: skip
    assert long_context.main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert not res["errors"] and not res["skipped"] and len(res["settings"]) == 3
    text, pts = res["text"]["600"], res["ruler"]["600"]
    assert text["dense"]["kl"] == 0 and text["dense"]["top1"] == 1
    assert set(pts["dense"]) == set(ruler.TASKS) and all(
        0 <= v <= 100 for r in pts.values() for v in r.values()
    )
    s = res["summary"]
    for key in ("ppl_increase_pct_600", "bytes_fraction_600", "ruler_max_drop_pts"):
        assert s[key] is not None
    assert s["bytes_fraction_600"] < 1  # the default decodes sparsely at 600 (k = 512)
    answers = res["ruler_answers"]["600"]["dense"]
    assert len(answers) == len(ruler.TASKS) and all(
        len(a["answer"]) < 40 for a in answers
    )
    assert (
        "| 600 | dense |" in (out / "table.md").read_text()
        and (out / "plot.png").is_file()
    )


def test_suite_summary_takes_each_row():
    def row(n, ppl, drop, frac):
        return {"summary": {"default_setting": "d", f"ppl_increase_pct_{n}": ppl, f"bytes_fraction_{n}": frac,
                            "ruler_max_drop_pts": drop}}  # fmt: skip

    rows = {"qwen15b-16k": row(16384, 2.0, 4.0, 0.2), "qwen15b-32k": row(32768, 1.5, 6.0, 0.1),
            "smollm2-8k": row(8192, 1.3, None, 0.1),
            "qwen15b-4k-8k": {"summary": {"ppl_increase_pct_4096": 3.0, "ppl_increase_pct_8192": 4.0,
                                          "bytes_fraction_4096": 0.5, "bytes_fraction_8192": 0.375}}}  # fmt: skip
    s = long_report.suite_summary(rows)
    assert (s["qwen15b_ppl_increase_pct_16k"], s["qwen15b_ppl_increase_pct_32k"]) == (
        2.0,
        1.5,
    )
    assert s["ruler_max_drop_pts"] == 6.0 and s["smollm2_ppl_increase_pct"] == 1.3
    assert s["default_bytes_fraction_32k"] == 0.1 and s["default_setting"] == "d"
    assert (s["qwen15b_ppl_increase_pct_4k"], s["qwen15b_ppl_increase_pct_8k"]) == (3.0, 4.0)
    assert s["default_bytes_fraction_8k"] == 0.375
