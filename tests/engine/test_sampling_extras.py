"""Penalties, min_p, logprobs and grammar masks against plain PyTorch references."""

import json
import math

import pytest
import torch

from doublesparse.engine.engine import Engine
from doublesparse.engine.sampler import apply_penalties, filter_probs, token_logprobs
from doublesparse.engine.sampling_params import SamplingParams
from doublesparse.testing import ByteTokenizer, tiny_llama


def _reference_penalties(logits, outputs, prompts, rep, freq, pres):
    out = logits.clone()
    for b in range(logits.shape[0]):
        counts = {}
        for t in outputs[b]:
            counts[t] = counts.get(t, 0) + 1
        for t in set(outputs[b]) | set(prompts[b]):
            v = out[b, t].item()
            out[b, t] = v / rep[b] if v > 0 else v * rep[b]
        for t, n in counts.items():
            out[b, t] -= n * freq[b] + pres[b]
    return out


def test_penalties_match_reference():
    g = torch.Generator().manual_seed(0)
    B, V = 3, 37
    logits = torch.randn(B, V, generator=g) * 3
    outputs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (0, 5, 11)]
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (4, 1, 7)]
    rep, freq, pres = [1.3, 1.0, 0.7], [0.0, 0.5, -1.2], [0.4, 0.0, 1.5]
    counts = torch.zeros(B, V)
    mask = torch.zeros(B, V, dtype=torch.bool)
    for b in range(B):
        for t in outputs[b]:
            counts[b, t] += 1
        mask[b, prompts[b]] = True
    got = apply_penalties(logits, counts, mask, torch.tensor(rep), torch.tensor(freq),
                          torch.tensor(pres))
    torch.testing.assert_close(got, _reference_penalties(logits, outputs, prompts, rep, freq, pres))


def test_min_p_and_logprobs():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 29, generator=g) * 2
    one = torch.ones(2)
    probs, order = filter_probs(logits, one, one, torch.zeros(2, dtype=torch.long),
                                min_p=torch.tensor([0.0, 0.3]))
    p = torch.softmax(logits, -1)
    kept = (probs > 0).sum(-1)
    assert kept[0] == 29 and kept[1] == int((p[1] >= 0.3 * p[1].max()).sum())
    tok = torch.tensor([3, 17])
    packed = token_logprobs(logits, tok, 4)
    ref = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(packed[:, 0], ref[[0, 1], tok], rtol=1e-5, atol=1e-5)
    vals, ids = ref.topk(4, -1)
    torch.testing.assert_close(packed[:, 1:5], vals, rtol=1e-5, atol=1e-5)
    assert torch.equal(packed[:, 5:].long(), ids)


@pytest.mark.parametrize("bad", [dict(min_p=1.5), dict(repetition_penalty=0.0),
                                 dict(frequency_penalty=3.0), dict(logprobs=21),
                                 dict(presence_penalty=math.nan), dict(json_schema=""),
                                 dict(json_schema="{}", ebnf="root ::= \"a\"")])
def test_refuses_bad_values(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def _run_extras(model, overlap: bool):
    e = Engine(model=model, tokenizer=ByteTokenizer(), progress=False, device="cpu",
               max_total_tokens=1024)
    e.overlap = overlap
    schema = json.dumps({"type": "object", "additionalProperties": False, "required": ["v"],
                         "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 99}}})
    prompt = [5, 9, 200, 33]
    reqs = {"json": {"max_new_tokens": 30, "temperature": 1.0, "seed": 7, "json_schema": schema,
                     "logprobs": 2},
            "plain": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "pen": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True,
                    "frequency_penalty": 2.0, "repetition_penalty": 3.0}}
    rids = {e.add_request(prompt, sp): k for k, sp in reqs.items()}
    got = {k: [] for k in reqs}
    lps, meta = [], {}
    while e.has_unfinished():
        for o in e.step():
            k = rids[o.request_id]
            got[k] += o.new_token_ids
            lps += (o.logprobs or []) if k == "json" else []
            if o.finished:
                meta[k] = o.meta
    with pytest.raises(ValueError, match="invalid JSON schema"):
        e.add_request([1, 2], {"json_schema": "{not json"})
    e.flush_cache()  # finished requests leave their tokens in the prefix cache
    assert e.parts.memory.slots.num_used == 0
    return got, lps, meta


def test_engine_grammar_logprobs_and_penalties():
    """The same tokens under the overlap schedule (the default on CUDA), where the next step is
    launched before this one's tokens reach the host: penalties count on the device, and a
    constrained request's next mask waits for its token."""
    model = tiny_llama(max_position_embeddings=256)
    got, lps, meta = _run_extras(model, overlap=False)
    assert 0 <= json.loads(meta["json"]["text"])["v"] <= 99
    assert meta["json"]["finish_reason"] == "stop"
    assert len(lps) == len(got["json"]) and all(len(top) == 2 and lp <= 0 for lp, top in lps)
    assert got["pen"] != got["plain"]
    got_o, lps_o, _ = _run_extras(model, overlap=True)
    assert got_o == got and _floats(lps_o) == pytest.approx(_floats(lps))


def _floats(x) -> list[float]:
    """Every number of a nested list of logprobs, flat (``approx`` takes no nested lists)."""
    if isinstance(x, (list, tuple)):
        return [f for e in x for f in _floats(e)]
    return [float(x)] if isinstance(x, (int, float)) else []
