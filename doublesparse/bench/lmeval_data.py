"""The Shakespeare task's data for lm-evaluation-harness, built deterministically from the
evaluation plays (:data:`doublesparse.texts.EVAL_PLAYS`, never the calibration ones).

Three short-prompt tasks over verse lines of the plays' speeches (a speaker line such as
``Hor.`` followed by its lines):

* ``next_line`` (multiple choice): the speaker and three lines of a speech; which of four lines
  follows (the true one and three lines of similar length from other speeches of the same play).
* ``last_word`` (log-likelihood): two lines and a third without its last word; the word
  (lm-eval's ``acc`` is whether it is the greedy continuation, ``perplexity`` its likelihood).
* ``next_word`` (generate until a newline): two lines and the start of a third; the next word,
  compared with the first word of the generation.

``python -m doublesparse.bench.lmeval_data`` rewrites the jsonl files beside the task YAMLs
(``doublesparse/bench/lmeval_tasks/``); the same plays give the same files.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "lmeval_tasks"
SIZES = {"next_line": 60, "last_word": 60, "next_word": 40}
SEED = 20240607
_SPEAKER = re.compile(r"^[A-Z][A-Za-z]*(?: [A-Za-z]+)*\.$")
_WORD_END = re.compile(r"^(.*\S)\s+([A-Za-z]{3,})([^A-Za-z]*)$")


def speeches(text: str) -> list[tuple[str, list[str]]]:
    """(speaker, verse lines) of each speech: lines up to the first stage direction, each
    20-60 characters and starting with a capital letter (verse, not prose)."""
    out = []
    for block in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")):
        lines = [ln.strip() for ln in block.strip("\n").split("\n")]
        if len(lines) < 2 or len(lines[0]) > 24 or not _SPEAKER.match(lines[0]):
            continue
        body = []
        for ln in lines[1:]:
            if "[" in ln or "]" in ln or not (20 <= len(ln) <= 60) or not ln[0].isupper() \
                    or ln.isupper():
                break
            body.append(ln)
        if body:
            out.append((lines[0], body))
    return out


def _next_line(play: str, sp: list, rng: random.Random) -> list[dict]:
    pool = [(i, ln) for i, (_, body) in enumerate(sp) for ln in body]
    items = []
    for i, (who, body) in enumerate(sp):
        if len(body) < 4:
            continue
        s = rng.randrange(len(body) - 3)
        answer = body[s + 3]
        near = sorted({ln for j, ln in pool if j != i and ln != answer
                       and abs(len(ln) - len(answer)) <= 12})
        if len(near) < 3:
            continue
        choices = [answer] + rng.sample(near, 3)
        rng.shuffle(choices)
        items.append({"play": play, "context": "\n".join([who, *body[s:s + 3]]) + "\n",
                      "choices": choices, "gold": choices.index(answer)})
    return items


def _word_items(play: str, sp: list, rng: random.Random, last: bool) -> list[dict]:
    items = []
    for who, body in sp:
        if len(body) < 3:
            continue
        j = rng.randrange(2, len(body))
        head = "\n".join([who, *body[j - 2:j]]) + "\n"
        if last:
            m = _WORD_END.match(body[j])
            if m:
                items.append({"play": play, "context": head + m.group(1), "target": " " + m.group(2)})
            continue
        words = body[j].split(" ")
        if len(words) < 4:
            continue
        k = rng.randrange(2, len(words) - 1)
        word = re.sub(r"[^A-Za-z']", "", words[k])
        if len(word) >= 3 and word.isascii():
            items.append({"play": play, "context": head + " ".join(words[:k]), "target": word})
    return items


def build(sizes: dict[str, int] | None = None, seed: int = SEED) -> dict[str, list[dict]]:
    """Items of each task, ``sizes[task]`` of them, drawn at random from all evaluation plays."""
    from doublesparse.assets import read_play
    from doublesparse.texts import EVAL_PLAYS

    sizes = dict(SIZES if sizes is None else sizes)
    rng = random.Random(seed)
    by_task: dict[str, list[dict]] = {t: [] for t in sizes}
    for play in sorted(EVAL_PLAYS):
        sp = speeches(read_play(play))
        by_task["next_line"] += _next_line(play, sp, rng)
        by_task["last_word"] += _word_items(play, sp, rng, last=True)
        by_task["next_word"] += _word_items(play, sp, rng, last=False)
    out = {}
    for task, n in sizes.items():
        items = by_task[task]
        if len(items) < n:
            raise ValueError(f"{task}: only {len(items)} items in the plays, {n} wanted")
        picked = sorted(rng.sample(range(len(items)), n))
        out[task] = [{"id": k, **items[i]} for k, i in enumerate(picked)]
    return out


def write(out_dir: Path = TASKS_DIR, sizes: dict[str, int] | None = None) -> list[Path]:
    paths = []
    for task, items in build(sizes).items():
        p = Path(out_dir) / f"{task}.jsonl"
        p.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in items), encoding="utf-8")
        paths.append(p)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m doublesparse.bench.lmeval_data",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=TASKS_DIR)
    a = p.parse_args(argv)
    for path in write(a.out_dir):
        print(f"wrote {path} ({sum(1 for _ in path.open())} items)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
