"""Incremental detokenization with stop strings, for streaming text deltas."""

from __future__ import annotations


class Detokenizer:
    """Tracks one request's output text.

    ``push(output_ids)`` re-decodes the output and returns ``(delta, stop_hit)``. Text that could
    still change is held back: a trailing U+FFFD (an incomplete multi-byte character) and any
    suffix that is a prefix of a stop string. On a stop-string hit the text is cut before it.
    Without a tokenizer (dummy weights) the text stays empty.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip = skip_special_tokens
        self.text = ""       # the full visible text so far (after any stop cut)
        self.sent = 0        # characters of self.text already returned as deltas
        self._pending = ""   # decoded text not yet safe to send

    def push(self, output_ids: list[int]) -> tuple[str, bool]:
        if self.tokenizer is None:
            return "", False
        full = self.tokenizer.decode(output_ids, skip_special_tokens=self.skip)
        for s in self.stop:
            i = full.find(s)
            if i >= 0:
                self.text = full[:i]
                return "", True
        self.text = full
        safe = len(full)
        if full.endswith("\ufffd"):
            safe -= 1
        for s in self.stop:
            for k in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:k]):
                    safe = min(safe, len(full) - k)
                    break
        if safe <= self.sent:
            return "", False
        delta = full[self.sent: safe]
        self.sent = safe
        return delta, False

    def flush(self) -> str:
        """Everything not sent yet (the request is finishing)."""
        delta = self.text[self.sent:]
        self.sent = len(self.text)
        return delta
