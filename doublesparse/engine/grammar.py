"""Constrained decoding with xgrammar: JSON schemas and EBNF grammars as per-step token masks.

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

import torch

from .transfer import to_device


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
            raise ValueError("constrained decoding (response_format, json_schema, ebnf, tool_choice "
                             f"required) needs the xgrammar package: pip install xgrammar ({e})") from None
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

    def matcher(self, json_schema: str | None = None, ebnf: str | None = None):
        """A fresh matcher for one request; ValueError (the client's fault) if the grammar is bad."""
        try:
            if json_schema is not None:
                compiled = self.compiler.compile_json_schema(json_schema, any_whitespace=False)
            else:
                compiled = self.compiler.compile_grammar(ebnf)
        except Exception as e:
            what = "JSON schema" if json_schema is not None else "EBNF grammar"
            raise ValueError(f"invalid {what}: {e}") from None
        return self.xgr.GrammarMatcher(compiled)

    def mask_logits(self, logits: torch.Tensor, rows: list[int], matchers: list) -> torch.Tensor:
        """Set the logits of tokens the matchers forbid to -inf, in place.

        logits [N, V] float32 (V may exceed the tokenizer's vocabulary: the extra ids are
        forbidden); rows: which rows are constrained, matchers: theirs, in the same order.
        """
        bitmask = self.xgr.allocate_token_bitmask(len(rows), self.vocab_size)   # [n, V/32] int32
        for j, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, j)
        dev = logits.device
        sub = logits[to_device(torch.tensor(rows), dev)]
        self.xgr.apply_token_bitmask_inplace(sub, to_device(bitmask, dev))
        logits[to_device(torch.tensor(rows), dev)] = sub
        return logits
