"""Incremental detokenization with stop strings, for streaming text deltas.

Byte-level tokenizers (GPT-2 style BPE, SentencePiece byte fallback) split a multi-byte UTF-8
character over several tokens, and decoding a prefix that ends inside one yields U+FFFD. Text
leaves the engine only in whole characters: the tokens of an incomplete character are held back
until it completes, bytes that can never form a character are dropped, and so are incomplete bytes
left when the request ends. Streaming deltas therefore concatenate to exactly the final text.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Tracks one request's output text.

    ``push(output_ids)`` decodes the tokens added since the last call and returns
    ``(delta, stop_hit)``; ``flush()`` ends the request and returns what was held back. Held back:
    the tokens of an incomplete character, and any suffix of the text that is a prefix of a stop
    string. On a stop-string hit the text is cut before it. Without a tokenizer (dummy weights)
    the text stays empty.

    Decoding is incremental, as in vLLM: only the tokens after the last completed character are
    re-decoded, preceded by the tokens of the previous completed piece so that tokenizers that
    drop or add a leading space at the start of a decode (SentencePiece) see the same context
    every time; the new text is the difference of the two decodes.
    """

    def __init__(
        self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.skip = skip_special_tokens
        # the visible text so far (whole characters, cut at a stop string), and how much of it
        # was returned as deltas
        self.text = ""
        self.sent = 0
        self.stopped = False
        # token offsets: ids[_prefix:_read] is the last committed piece, ids[_read:] the tokens
        # not yet turned into text
        self._prefix = 0
        self._read = 0
        self._ids: list[int] = []

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def _take(self, final: bool) -> str:
        """Text of the uncommitted tokens, if it ends on a whole character (or ``final``)."""
        ids = self._ids
        if self._read >= len(ids):
            return ""
        before = self._decode(ids[self._prefix : self._read])
        after = self._decode(ids[self._prefix :])
        if after.endswith(REPLACEMENT) and not final:
            return ""  # an incomplete character: wait for its remaining bytes
        if len(after) <= len(before):
            return ""  # nothing visible added yet (e.g. skipped special tokens)
        self._prefix, self._read = self._read, len(ids)
        # a U+FFFD left inside is a byte sequence that can never form a character
        return after[len(before) :].replace(REPLACEMENT, "")

    def _commit(self, new: str, match_stop: bool = True) -> bool:
        """Append new text; cut it at the first stop string (when ``match_stop``). Returns
        whether one was hit."""
        if not new:
            return False
        if not match_stop:
            self.text += new
            return False
        longest = max((len(s) for s in self.stop), default=0)
        # a stop string not found before can only end in the new text
        start = max(0, len(self.text) - longest + 1)
        self.text += new
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return bool(hits)

    def _safe_len(self) -> int:
        """Length of the text that can be sent: without a suffix that may begin a stop string."""
        safe = len(self.text)
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    safe = min(safe, len(self.text) - k)
                    break
        return safe

    def push(self, output_ids: list[int], match_stop: bool = True) -> tuple[str, bool]:
        """``match_stop`` False: the new text is not searched for stop strings (a stop string
        that ends later is still found, from where the last search left off)."""
        if self.tokenizer is None or self.stopped:
            return "", self.stopped
        self._ids = list(output_ids)
        if self._commit(self._take(final=False), match_stop):
            return "", True
        safe = self._safe_len()
        if safe <= self.sent:
            return "", False
        delta = self.text[self.sent : safe]
        self.sent = safe
        return delta, False

    def flush(self) -> str:
        """Everything not sent yet (the request is finishing); incomplete bytes are dropped."""
        if self.tokenizer is not None and not self.stopped:
            self._commit(self._take(final=True))
        delta = self.text[self.sent :]
        self.sent = len(self.text)
        return delta
