"""json_object that always closes: the tracker against xgrammar's matcher of the same grammar
(random walks), the per-byte growth bound, and the bounded matcher on byte and multi-byte
vocabularies and in the engine: whenever the request ends with "stop", the text parses."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("xgrammar")

from doublesparse.engine.engine import Engine  # noqa: E402
from doublesparse.engine.grammar import GrammarBackend  # noqa: E402
from doublesparse.engine.json_object import BYTE_GROWTH, JsonTracker  # noqa: E402
from doublesparse.engine.sampling_params import SamplingParams  # noqa: E402
from doublesparse.testing import ByteTokenizer, tiny_llama  # noqa: E402

STRUCTURE = set(b'{}[]",:tfn0-.eE\\u \n') | {0xC3, 0xE6, 0xF0}
EOS = 300
MULTI = [b'{"', b'","', b'":', b'": "', b'":{"', b'":[', b'"}', b'}}', b'"]}', b'\\u', b'\\u00',
         b'fals', b'true', b'null', b'[[[', b'{{', b',"', b', "', b'":0', b'e-', b'.5e+',
         b'\xe6\x97', b'\xf0\x9f', b'\x98\x80', b'\xa5\xe6', b'hello', b' world', b'\n  "',
         b'",,"', b'ff', b',,,,']


class _Vocab:
    """A tokenizer for GrammarBackend with exactly these tokens (id = index), EOS at 300."""

    def __init__(self, multi: bool) -> None:
        toks = [b""] + [bytes([i]) for i in range(1, 256)] + (MULTI if multi else [])
        self.toks = toks + [b""] * (EOS + 1 - len(toks))

    def vocab_bytes(self) -> list[bytes]:
        return self.toks


def _backend(multi: bool) -> GrammarBackend:
    v = _Vocab(multi)
    return GrammarBackend(v, len(v.toks), [EOS])


def _allowed(matcher, backend) -> list[int]:
    bm = backend.xgr.allocate_token_bitmask(1, backend.vocab_size)
    matcher.fill_next_token_bitmask(bm, 0)
    words = bm[0].numpy().view("uint32")
    return [t for t in range(backend.vocab_size) if (int(words[t // 32]) >> (t % 32)) & 1]


def _pick(rng: random.Random, allowed: list[int], toks: list[bytes]) -> int:
    weights = [25 if t == EOS or (toks[t] and toks[t][0] in STRUCTURE) or len(toks[t]) > 1 else 1
               for t in allowed]
    return rng.choices(allowed, weights)[0]


def test_tracker_matches_the_grammar_and_its_growth_bound():
    """Random walks through the grammar: every byte lengthens the closing by at most its
    BYTE_GROWTH, and the closing completes the object for xgrammar and for json.loads."""
    backend = _backend(multi=False)
    toks = backend.info.decoded_vocab
    rng = random.Random(0)
    for walk in range(150):
        m = backend.matcher(SamplingParams(json_object=True, max_new_tokens=10**6)).m
        tr, text = JsonTracker(), b""
        for _ in range(rng.randint(1, 80)):
            allowed = [t for t in _allowed(m, backend) if t != EOS]
            if not allowed:
                break
            t = _pick(rng, allowed, toks)
            before = len(tr.closing())
            assert m.accept_token(t)
            tr.feed(toks[t])
            text += toks[t]
            assert len(tr.closing()) - before <= BYTE_GROWTH[toks[t][0]], (text, tr.closing())
            fork = m.fork()
            assert fork.accept_string(tr.closing()) and fork.is_completed(), (text, tr.closing())
            assert isinstance(json.loads(text + tr.closing()), dict)
            if tr.done:
                break


@pytest.mark.parametrize("multi", [False, True])
def test_bounded_matcher_always_closes_within_budget(multi):
    """Random tokens (structure-heavy, multi-byte tokens that open several things at once),
    every budget from 2 to 40: the object ends with the stop token within the budget and
    parses, except for budgets too small for ``{}`` plus the stop token."""
    backend = _backend(multi)
    toks = backend.info.decoded_vocab
    rng = random.Random(1)
    for budget in range(2, 41):
        for _ in range(6):
            m = backend.matcher(SamplingParams(json_object=True, max_new_tokens=budget))
            text, n = b"", 0
            while n < budget and not m.is_terminated():
                t = _pick(rng, _allowed(m, backend), toks)
                assert m.accept_token(t), (budget, text, toks[t])
                n += 1
                text += toks[t] if t != EOS else b""
            if budget >= 3:
                assert m.is_terminated(), (budget, text)
                assert isinstance(json.loads(text), dict)
            else:
                assert text == b"{}"[:budget]


def test_engine_json_object_finishes_with_stop_and_parses():
    """In the engine (tiny model, sampled): short budgets still close, n > 1 each on its own."""
    e = Engine(model=tiny_llama(max_position_embeddings=256), tokenizer=ByteTokenizer(),
               progress=False, device="cpu", max_total_tokens=4096)
    sps = [{"max_new_tokens": mx, "temperature": 1.0, "seed": s, "json_object": True}
           for mx in (3, 5, 12, 40) for s in range(3)]
    outs = e.generate([[5, 9, 200, 33]] * len(sps), sps)
    for sp, o in zip(sps, outs):
        assert o["meta"]["finish_reason"] == "stop", (sp, o["text"])
        assert isinstance(json.loads(o["text"]), dict)
        assert len(o["token_ids"]) <= sp["max_new_tokens"]
