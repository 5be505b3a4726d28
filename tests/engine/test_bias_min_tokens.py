"""logit_bias, min_tokens and regex in the engine (tiny random Llama, byte tokens), batched
with requests that ask for none of them, with and without the overlap schedule."""

from __future__ import annotations

import re

import pytest
import torch

from doublesparse.engine.engine import Engine
from doublesparse.engine.sampler import _scatter_rows
from doublesparse.engine.sampling_params import SamplingParams
from doublesparse.testing import ByteTokenizer, tiny_llama

PROMPT = [5, 9, 200, 33]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(max_position_embeddings=256)


def _engine(model, overlap=False) -> Engine:
    e = Engine(model=model, tokenizer=ByteTokenizer(), progress=False, device="cpu",
               max_total_tokens=4096)
    e.overlap = overlap
    return e


def _run(e: Engine, sps: list[dict]) -> list[dict]:
    return e.generate([PROMPT] * len(sps), sps)


def test_scatter_rows_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 11, generator=g)
    ids = [torch.tensor([1, 7]), torch.tensor([10])]
    vals = [torch.tensor([2.5, -1.0]), torch.tensor([100.0])]
    ref = logits.clone()
    ref[0, 1] += 2.5
    ref[0, 7] -= 1.0
    ref[3, 10] += 100.0
    got = logits.clone()
    _scatter_rows(got, [0, 3], ids, vals, accumulate=True)
    torch.testing.assert_close(got, ref)
    _scatter_rows(got, [2], [torch.tensor([4, 5])], None, accumulate=False)
    assert got[2, 4] == got[2, 5] == float("-inf") and torch.isfinite(got[[0, 1, 3]]).all()


@pytest.mark.parametrize("overlap", [False, True])
def test_logit_bias(model, overlap):
    e = _engine(model, overlap)
    base = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    plain = _run(e, [base])[0]["token_ids"]
    first = plain[0]
    outs = _run(e, [base, {**base, "logit_bias": {first: -100.0}},
                    {**base, "logit_bias": {"65": 100.0}},
                    {**base, "temperature": 1.0, "seed": 3, "logit_bias": {66: 100, 67: 100}}])
    assert outs[0]["token_ids"] == plain        # its neighbours' biases do not leak into it
    assert outs[1]["token_ids"][0] != first and first not in outs[1]["token_ids"]
    assert outs[2]["token_ids"] == [65] * 8
    assert set(outs[3]["token_ids"]) <= {66, 67}
    with pytest.raises(ValueError, match="past the vocabulary"):
        e.add_request(PROMPT, {"logit_bias": {10**6: 1.0}})


@pytest.mark.parametrize("overlap", [False, True])
def test_min_tokens_holds_back_stop_ids_and_strings(model, overlap):
    e = _engine(model, overlap)
    plain = _run(e, [{"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}])[0]
    stop = plain["token_ids"][1]
    base = {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop]}
    early, held = _run(e, [base, {**base, "min_tokens": 5}])
    assert early["meta"]["finish_reason"] == "stop" and len(early["token_ids"]) == 2
    assert stop not in held["token_ids"][:5] and len(held["token_ids"]) > 5
    # a stop string is not matched before min_tokens tokens were generated (vLLM's rule)
    a = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": ["a"],
         "logit_bias": {97: 100}}
    cut, late = _run(e, [a, {**a, "min_tokens": 4}])
    assert cut["meta"]["finish_reason"] == "stop" and cut["text"] == ""
    assert late["meta"]["finish_reason"] == "stop" and late["text"] == "aaaa"
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_new_tokens=3, min_tokens=4)


def test_min_tokens_yields_to_a_grammar_that_can_only_end(model):
    """A grammar that is complete allows only the stop token: min_tokens does not mask it."""
    e = _engine(model)
    out = _run(e, [{"max_new_tokens": 10, "temperature": 0, "regex": "ab", "min_tokens": 6}])[0]
    assert out["text"] == "ab" and out["meta"]["finish_reason"] == "stop"
    out = _run(e, [{"max_new_tokens": 10, "temperature": 1.0, "seed": 2, "regex": "[a-c]+",
                    "min_tokens": 6}])[0]
    assert re.fullmatch("[a-c]{6,}", out["text"]), out


def test_regex(model):
    e = _engine(model)
    outs = _run(e, [{"max_new_tokens": 20, "temperature": 1.0, "seed": s,
                     "regex": r"(yes|no)\. [0-9]{3}"} for s in range(4)])
    for o in outs:
        assert re.fullmatch(r"(yes|no)\. [0-9]{3}", o["text"])
        assert o["meta"]["finish_reason"] == "stop"
    with pytest.raises(ValueError, match="invalid regular expression"):
        e.add_request(PROMPT, {"regex": "(a"})
