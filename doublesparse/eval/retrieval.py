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

from doublesparse.texts import encode

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


def _prompt_ids(tokenizer, units: int, depth: float, key: str) -> list[int]:
    cut = round(depth * units)
    hay = FILLER * cut + NEEDLE.format(key=key) + FILLER * (units - cut)
    return encode(tokenizer, _wrap(tokenizer, INSTRUCTION + hay.strip() + QUESTION))


def filler_units(tokenizer, context_len: int, depth: float, key: str = "12345") -> int:
    """Filler repeats that bring the prompt close to ``context_len`` tokens (an estimate from
    the per-repeat token cost; :func:`build_prompt` trims it if the real prompt is longer)."""
    base = len(_prompt_ids(tokenizer, 0, depth, key))
    per = max(1.0, (len(_prompt_ids(tokenizer, 20, depth, key)) - base) / 20)
    return max(0, int((context_len - base) / per))


def build_prompt(tokenizer, context_len: int, depth: float, key: str, units: int | None = None) -> list[int]:
    """Token ids of a prompt of about ``context_len`` tokens (never more). ``units``: a start
    value from :func:`filler_units` (computed once per length and depth, saving 2 encodes)."""
    units = filler_units(tokenizer, context_len, depth, key) if units is None else units
    ids = _prompt_ids(tokenizer, units, depth, key)
    while len(ids) > context_len and units > 0:  # tokenisation at the joins is not exactly linear
        units -= 1
        ids = _prompt_ids(tokenizer, units, depth, key)
    return ids


def make_trials(tokenizer, context_lens, depths, trials_per_cell: int = 1, seed: int = 0) -> list[Trial]:
    """``trials_per_cell`` trials per (length, depth), keys drawn in this order from ``seed``."""
    rng = random.Random(seed)
    out = []
    for n in context_lens:
        for d in depths:
            units = None
            for _ in range(trials_per_cell):
                key = str(rng.randint(10000, 99999))
                units = units if units is not None else filler_units(tokenizer, n, d, key)
                out.append(Trial(n, d, key, tuple(build_prompt(tokenizer, n, d, key, units))))
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


class RetrievalRunner:
    """Trials prefilled once per K/V cache dtype (dense, shared by every setting of that dtype:
    driver.PoolSet); :meth:`run` answers them all greedily with one setting. Trials of one context length form a group (``batch_trials`` at a
    time, 0: all) decoded as one batch; k scales with the group's context length."""

    def __init__(self, model, tokenizer, trials: list[Trial], device="cpu", batch_trials: int = 0,
                 impl: str = "auto", k_rotation: str = "auto"):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        by_len: dict[int, list[Trial]] = {}
        for t in trials:
            by_len.setdefault(t.context_len, []).append(t)
        self.groups = []  # (context_len, trials, pool set)
        with torch.inference_mode():
            for n, ts in sorted(by_len.items()):
                step = batch_trials or len(ts)
                for i in range(0, len(ts), step):
                    part = ts[i:i + step]
                    max_ctx = max(len(t.ids) for t in part) + ANSWER_TOKENS
                    pools = driver.PoolSet(model, [list(t.ids[:-1]) for t in part], max_ctx, device=device,
                                           impl=impl, k_rotation=k_rotation)
                    pools.get("auto")
                    self.groups.append((n, part, pools))
        self.results: dict[Setting, dict] = {}

    @torch.inference_mode()
    def run(self, s: Setting, channels_for) -> dict:
        """``{"acc": float, "cells": {(len, depth): acc}, "answers": [...]}`` for ``s`` (also kept
        in ``self.results``)."""
        ok: dict = {}
        answers = []
        ch = channels_for(s) if s.kind == "ds" else None
        for n, ts, pool_set in self.groups:
            pools = pool_set.get(s.kv)
            if ch is not None:
                pools.relabel(ch, s.label)
            new = driver.greedy(self.model, pools, s, ch, [t.ids[-1] for t in ts], ANSWER_TOKENS,
                                s.k_for(n))
            for t, toks in zip(ts, new):
                text = decode_text(self.tokenizer, toks)
                good = answer_ok(text, t.key)
                ok.setdefault((t.context_len, t.depth), []).append(good)
                answers.append({"len": t.context_len, "prompt_tokens": len(t.ids), "depth": t.depth,
                                "key": t.key, "answer": text.strip(), "ok": good})
        allv = [x for v in ok.values() for x in v]
        res = {"acc": sum(allv) / max(len(allv), 1), "cells": {k: sum(v) / len(v) for k, v in ok.items()},
               "answers": answers}
        self.results[s] = res
        return res


def evaluate_retrieval(model, tokenizer, trials: list[Trial], settings: list[Setting], channels_for,
                       device="cpu", batch_trials: int = 0, progress: bool = True,
                       k_rotation: str = "auto") -> dict:
    """Accuracy of every setting: ``{setting: RetrievalRunner.run(setting)}``."""
    runner = RetrievalRunner(model, tokenizer, trials, device, batch_trials, k_rotation=k_rotation)
    for s in tqdm(settings, desc="eval retrieval", unit="setting", disable=not progress):
        runner.run(s, channels_for)
    return {s: runner.results[s] for s in settings}
