"""UTF-8-safe incremental detokenization: no U+FFFD ever leaves the engine, and streamed deltas
concatenate to the final text, with SmolLM2's byte-level BPE tokenizer and a byte tokenizer."""

import pytest

from doublesparse.engine import Engine
from doublesparse.engine.text import Detokenizer
from doublesparse.testing import ByteTokenizer, tiny_llama

# emoji (4-byte, with variation selectors and ZWJ sequences) and CJK (3-byte) text
TEXTS = ["🌳🌞☀️ sun 🌞🌞", "日本語の文章です。", "👩‍💻 写代码 ☕", "ünïcödé ☀️ 日"]

pytestmark = pytest.mark.usefixtures("one_thread")


def run(tok, ids, stop=()):
    d = Detokenizer(tok, stop)
    deltas, hit = [], False
    for i in range(1, len(ids) + 1):
        delta, hit = d.push(ids[:i])
        deltas.append(delta)
        if hit:
            break
    deltas.append(d.flush())
    return deltas, d.text, hit


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from doublesparse.models import load_tokenizer

    return load_tokenizer(None)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_bpe_prefixes_never_emit_partial_characters(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    # the tokenizer does split characters
    assert len(ids) > len(text.encode("utf-8")) // 4
    for n in range(1, 9):
        deltas, final, _ = run(tok, ids[:n])
        assert "\ufffd" not in final and "".join(deltas) == final
        # whole characters of the prefix, nothing invented
        assert (
            text.startswith(final)
            and len(final) >= len(tok.decode(ids[:n]).rstrip("\ufffd")) - 1
        )
    assert run(tok, ids)[1] == text


def test_stop_string_made_of_multibyte_characters(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("🌳🌞☀️ sun", add_special_tokens=False)
    deltas, final, hit = run(tok, ids, stop=("🌞☀",))
    assert hit and final == "🌳" and "".join(deltas) == "🌳"


def test_bytes_that_never_form_a_character_are_dropped():
    tok = ByteTokenizer()
    # a cut 4-byte character, then a whole 3-byte one, then a cut 3-byte one
    ids = [*b"ab", 0xF0, 0x9F, *b"c", *"日".encode(), 0xE6, 0x97]
    deltas, final, _ = run(tok, ids)
    assert final == "abc日" and "".join(deltas) == final
    assert deltas[:3] == ["a", "b", ""]  # the incomplete bytes were held, not sent


@pytest.fixture(scope="module")
def byte_engine():
    # a random model over byte tokens emits arbitrary byte sequences: many partial characters
    model = tiny_llama(seed=3, max_position_embeddings=512)
    return Engine(
        model=model,
        tokenizer=ByteTokenizer(),
        progress=False,
        max_total_tokens=4096,
        max_running_requests=16,
    )


def test_engine_matrix_streaming_equals_generate(byte_engine):
    e = byte_engine
    sps = [
        {"max_new_tokens": n, "temperature": 1.0, "seed": 7 + n, "ignore_eos": True}
        for n in range(1, 9)
    ]
    cases = [(t, sp) for t in TEXTS for sp in sps]
    whole = e.generate([t for t, _ in cases], [sp for _, sp in cases])
    streamed = {e.add_request(t, sp): "" for t, sp in cases}
    order = list(streamed)
    while e.has_unfinished():
        for o in e.step():
            streamed[o.request_id] += o.text
    saw_bytes = 0
    for r, rid in zip(whole, order):
        assert "\ufffd" not in r["text"] and streamed[rid] == r["text"]
        saw_bytes += any(t >= 128 for t in r["token_ids"])
    assert saw_bytes > len(cases) // 2  # the matrix did exercise multi-byte sequences
