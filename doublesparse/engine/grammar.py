"""Constrained decoding with xgrammar: JSON schemas, EBNF grammars, regular expressions and
``json_object`` (:mod:`json_object`) as per-step token masks.

One :class:`GrammarBackend` per engine builds xgrammar's view of the vocabulary once (the first
constrained request pays ~0.3 s for it) and compiles each request's grammar (cached by
xgrammar). Each constrained request owns a matcher: before a step samples it, the matcher fills
the request's row of a token bitmask (on the host), which goes to the device with the logits'
other inputs and masks the disallowed tokens to -inf; after the token is known on the host the
matcher accepts it. That needs the previous token on the host before the next launch, so the
engine does not overlap steps while a constrained request runs.

xgrammar is optional: without it, a constrained request is refused with a clear message.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from .json_object import GRAMMAR as JSON_OBJECT_GRAMMAR
from .json_object import BoundedJsonObject, ClosingTable
from ..kernels.transfer import to_device


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except Exception:
        return False
    return True


class GrammarBackend:
    """Compiles grammars for one tokenizer and vocabulary (the model's logits width)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        try:
            import xgrammar as xgr
        except Exception as e:
            raise ValueError("constrained decoding (response_format, json_schema, regex, ebnf, "
                             "tool_choice required) needs the xgrammar package: pip install "
                             f"xgrammar ({e})") from None
        if tokenizer is None:
            raise ValueError("constrained decoding needs a tokenizer (this engine has none)")
        self.xgr = xgr
        vocab = getattr(tokenizer, "vocab_bytes", None)
        if callable(vocab):  # tokenizers that know their tokens' exact bytes (the test tokenizer)
            info = xgr.TokenizerInfo(vocab(), xgr.VocabType.RAW, vocab_size=vocab_size,
                                     stop_token_ids=list(stop_token_ids))
        else:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=list(stop_token_ids) or None)
        self.info = info
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._closing: ClosingTable | None = None   # json_object's, built by its first request

    def matcher(self, params):
        """A fresh matcher for one request (``params``: its SamplingParams, which is
        constrained); ValueError (the client's fault) if the grammar is bad."""
        what = ("JSON schema" if params.json_schema is not None else
                "regular expression" if params.regex is not None else "EBNF grammar")
        try:
            if params.json_schema is not None:
                compiled = self.compiler.compile_json_schema(params.json_schema,
                                                             any_whitespace=False)
            elif params.regex is not None:
                compiled = self.compiler.compile_regex(params.regex)
            elif params.json_object:
                compiled = self.compiler.compile_grammar(JSON_OBJECT_GRAMMAR)
            else:
                compiled = self.compiler.compile_grammar(params.ebnf)
        except Exception as e:
            raise ValueError(f"invalid {what}: {grammar_error(e)}") from None
        m = self.xgr.GrammarMatcher(compiled)
        if not params.json_object:
            return m
        if self._closing is None:
            self._closing = ClosingTable(self.info.decoded_vocab, self.vocab_size)
        if not self._closing.usable:  # a vocabulary without single-byte closers: plain grammar
            return m
        return BoundedJsonObject(m, self._closing, self.info.decoded_vocab, params.max_new_tokens)

    def mask_logits(self, logits: torch.Tensor, rows: list[int], matchers: list,
                    avoid: list | None = None) -> torch.Tensor:
        """Set the logits of tokens the matchers forbid to -inf, in place.

        logits [N, V] float32 (V may exceed the tokenizer's vocabulary: the extra ids are
        forbidden); rows: which rows are constrained, matchers: theirs, in the same order.
        avoid: per row, token ids to forbid as well unless the grammar allows nothing else (the
        stop ids of a request short of min_tokens), or None.
        """
        bitmask = self.xgr.allocate_token_bitmask(len(rows), self.vocab_size)   # [n, V/32] int32
        for j, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, j)
            if avoid is not None and avoid[j]:
                _clear_unless_alone(bitmask[j].numpy().view(np.uint32), avoid[j])
        dev = logits.device
        sub = logits[to_device(torch.tensor(rows), dev)]
        self.xgr.apply_token_bitmask_inplace(sub, to_device(bitmask, dev))
        logits[to_device(torch.tensor(rows), dev)] = sub
        return logits


def _clear_unless_alone(words: np.ndarray, ids) -> None:
    """Clear the bits of ``ids`` in one bitmask row ([V/32] uint32, a view) unless no other
    bit would be left."""
    kept = words.copy()
    for t in ids:
        if t < words.shape[0] * 32:
            kept[t // 32] &= ~np.uint32(1 << (t % 32))
    if kept.any():
        words[:] = kept


def grammar_error(e: Exception) -> str:
    """xgrammar's message without the time and C++ source location it starts with."""
    return re.sub(r"^\[[^\]]*\]\s+\S+\.(?:cc|cpp|h):\d+:\s*", "", str(e).strip())
