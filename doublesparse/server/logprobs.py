"""Token log-probabilities in the two OpenAI shapes, and each token's exact text and bytes.

The engine reports, per generated token, ``(logprob, [(token id, logprob)] * k)`` from the
model's own distribution (raw logits, before penalties, temperature and masks). A token's text is
its exact bytes when they form valid UTF-8, else ``"bytes:\\xNN..."`` (as vLLM writes a piece of
a multi-byte character), so no U+FFFD is ever made up here.
"""

from __future__ import annotations

import functools


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """Exact bytes and display text of token ids for one tokenizer (cached per id)."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        vb = getattr(tokenizer, "vocab_bytes", None)
        self._table = vb() if callable(vb) else None
        self._special = set(getattr(tokenizer, "all_special_ids", None) or ())
        self.bytes = functools.lru_cache(maxsize=1 << 16)(self._bytes)

    def _bytes(self, i: int) -> bytes:
        if self._table is not None:
            return self._table[i] if 0 <= i < len(self._table) else b""
        if i in self._special:
            return str(self.tok.convert_ids_to_tokens(i)).encode()
        text = self.tok.decode([i], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        piece = self.tok.convert_ids_to_tokens(i)
        dec = _byte_decoder()
        if isinstance(piece, str) and piece and all(c in dec for c in piece):
            return bytes(dec[c] for c in piece)       # byte-level BPE (GPT-2, Llama 3, Qwen)
        if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x"):
            return bytes([int(piece[3:5], 16)])         # SentencePiece byte fallback
        return text.encode()

    def text(self, i: int) -> str:
        b = self.bytes(i)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def chat_logprobs(tt: TokenText, ids: list[int], lps: list) -> dict:
    """``choices[i].logprobs`` of a chat completion (or of one streamed chunk)."""
    def entry(i: int, lp: float) -> dict:
        return {"token": tt.text(i), "logprob": lp, "bytes": list(tt.bytes(i))}
    content = [{**entry(i, lp), "top_logprobs": [entry(j, v) for j, v in top]}
               for i, (lp, top) in zip(ids, lps)]
    return {"content": content, "refusal": None}


def completion_logprobs(tt: TokenText, ids: list[int], lps: list, offset: int) -> dict:
    """``choices[i].logprobs`` of a completion: ``offset`` is the text length before the first
    of these tokens (for ``text_offset``). ``top_logprobs`` holds the k alternatives and the
    sampled token, as in vLLM. An entry of ``lps`` may be None (a prompt's first token, which
    nothing predicts): its ``token_logprobs`` and ``top_logprobs`` entries are null, as OpenAI's."""
    tokens, offsets, token_lps, tops = [], [], [], []
    for i, e in zip(ids, lps):
        s = tt.text(i)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if e is None:
            token_lps.append(None)
            tops.append(None)
            continue
        lp, top = e
        d = {tt.text(j): v for j, v in top}
        d.setdefault(s, lp)
        token_lps.append(lp)
        tops.append(d)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def echo_logprobs(tt: TokenText, prompt_ids: list[int], prompt_lps: list | None, ids: list[int],
                  lps: list, prompt_text_len: int) -> dict:
    """``choices[i].logprobs`` of a completion with ``echo``: the prompt's tokens (offsets from 0)
    then the completion's (offsets from the echoed prompt text's length), one object, as OpenAI's
    legacy completions and vLLM return it (lm-evaluation-harness scores continuations with it).
    ``prompt_lps`` None (the request ended before its prompt was scored): nulls."""
    head = completion_logprobs(tt, prompt_ids, prompt_lps or [None] * len(prompt_ids), 0)
    tail = completion_logprobs(tt, ids, lps, prompt_text_len)
    return {k: head[k] + tail[k] for k in head}
