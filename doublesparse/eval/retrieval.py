"""Pass-key retrieval: a number hidden at a given depth of a long filler text, answered greedily.

Prompt design (why it looks like this): SmolLM2 is an instruct model, and with a plain prompt it
found the key only 20-40% of the time at 2-4K. We (1) wrap the task in the model's own chat
template, (2) say up front that a pass key is hidden and will be asked for, (3) state the needle
twice in one sentence pair, and (4) open the assistant's turn with "The pass key is", so the first
generated tokens must be the digits. The instruction sits before the haystack and the question
after it; the needle is inserted between filler sentences at ``depth`` (0 = right after the
instruction, 1 = right before the question).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from doublesparse.calibrate.texts import encode

from . import driver
from .settings import Setting

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
INSTRUCTION = ("There is a pass key hidden inside the following long text. Find it and memorize it. "
               "I will ask you for the pass key at the end.\n\n")
QUESTION = "\n\nWhat is the pass key? Answer with the number only."
ANSWER_PREFIX = "The pass key is"
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
ANSWER_TOKENS = 8


@dataclass(frozen=True)
class Trial:
    context_len: int   # target prompt length in tokens
    depth: float       # 0..1
    key: str
    ids: tuple[int, ...] = field(repr=False)


def _wrap(tokenizer, user: str) -> str:
    tmpl = getattr(tokenizer, "chat_template", None)
    if tmpl and hasattr(tokenizer, "apply_chat_template"):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
        return text + ANSWER_PREFIX
    return f"User: {user}\nAssistant: {ANSWER_PREFIX}"


def build_prompt(tokenizer, context_len: int, depth: float, key: str) -> list[int]:
    """Token ids of a prompt of about ``context_len`` tokens (never more)."""
    def ids_for(units: int) -> list[int]:
        cut = round(depth * units)
        hay = FILLER * cut + NEEDLE.format(key=key) + FILLER * (units - cut)
        return encode(tokenizer, _wrap(tokenizer, INSTRUCTION + hay.strip() + QUESTION))

    base = len(ids_for(0))
    per = max(1.0, (len(ids_for(20)) - base) / 20)
    units = max(0, int((context_len - base) / per))
    ids = ids_for(units)
    while len(ids) > context_len and units > 0:  # tokenisation at the joins is not exactly linear
        units -= 1
        ids = ids_for(units)
    return ids


def make_trials(tokenizer, context_lens, depths, trials_per_cell: int = 1, seed: int = 0) -> list[Trial]:
    rng = random.Random(seed)
    out = []
    for n in context_lens:
        for d in depths:
            for _ in range(trials_per_cell):
                key = str(rng.randint(10000, 99999))
                out.append(Trial(n, d, key, tuple(build_prompt(tokenizer, n, d, key))))
    return out


def decode_text(tokenizer, ids) -> str:
    try:
        return tokenizer.decode(ids, skip_special_tokens=True)
    except TypeError:
        return tokenizer.decode(ids)


def answer_ok(text: str, key: str) -> bool:
    """The first number in the answer is the key."""
    m = re.search(r"\d+", text.replace(",", ""))
    return bool(m) and m.group(0) == key


@torch.inference_mode()
def evaluate_retrieval(model, tokenizer, trials: list[Trial], settings: list[Setting], channels_for,
                       device="cpu", batch_trials: int = 0, progress: bool = True) -> dict:
    """Accuracy of every setting. Returns ``{setting: {"acc": float, "cells": {(len, depth): acc},
    "answers": [...]}}``. Trials of one context length are prefilled together (once, shared by all
    settings) and decoded as one batch; k scales with each group's context length."""
    c = model.config
    by_len: dict[int, list[Trial]] = {}
    for t in trials:
        by_len.setdefault(t.context_len, []).append(t)
    res = {s: {"ok": {}, "answers": []} for s in settings}
    groups = []
    for n, ts in sorted(by_len.items()):
        step = batch_trials or len(ts)
        groups += [(n, ts[i:i + step]) for i in range(0, len(ts), step)]
    bar = tqdm(total=len(groups) * len(settings), desc="eval retrieval", unit="setting", disable=not progress)
    for n, ts in groups:
        max_ctx = max(len(t.ids) for t in ts) + ANSWER_TOKENS
        pools = driver.Pools(c, len(ts), max_ctx, device=device, dtype=getattr(model, "dtype", torch.float32))
        driver.prefill(model, pools, [list(t.ids[:-1]) for t in ts])
        for s in settings:
            ch = None
            if s.kind == "ds":
                ch = channels_for(s)
                pools.relabel(ch)
            new = driver.greedy(model, pools, s, ch, [t.ids[-1] for t in ts], ANSWER_TOKENS, s.heavy_tokens(n))
            for t, toks in zip(ts, new):
                text = decode_text(tokenizer, toks)
                ok = answer_ok(text, t.key)
                res[s]["ok"].setdefault((t.context_len, t.depth), []).append(ok)
                res[s]["answers"].append({"len": t.context_len, "prompt_tokens": len(t.ids), "depth": t.depth,
                                          "key": t.key, "answer": text.strip(), "ok": ok})
            bar.update()
    bar.close()
    out = {}
    for s, r in res.items():
        cells = {k: sum(v) / len(v) for k, v in r["ok"].items()}
        allv = [x for v in r["ok"].values() for x in v]
        out[s] = {"acc": sum(allv) / max(len(allv), 1), "cells": cells, "answers": r["answers"]}
    return out
