"""``doublesparse generate``'s line on why a request decoded densely."""

from types import SimpleNamespace

from doublesparse.attention.budget import DecodePolicy, TokenBudget
from doublesparse.generate import DEFAULT_TEMPERATURE, build_parser, dense_note


def _engine(policy):
    ds = None if policy is None else SimpleNamespace(policy=policy)
    return SimpleNamespace(parts=SimpleNamespace(ds=ds), max_context_len=8192)


def test_dense_note():
    meta = {"decode_steps": 9, "sparse_decode_steps": 0, "prompt_tokens": 40}
    assert "Double Sparsity is off" in dense_note(_engine(None), meta)
    note = dense_note(_engine(DecodePolicy(TokenBudget(512, 512, 1 / 16), 0)), meta)
    assert note.startswith("9 of 9 steps decoded densely: the request held 41 tokens")
    assert "from 513 tokens" in note
    assert dense_note(_engine(None), dict(meta, sparse_decode_steps=9)) is None


def test_default_sampling():
    a = build_parser().parse_args([])
    assert (a.temperature, a.top_p) == (DEFAULT_TEMPERATURE, 0.9) and a.temperature > 0
