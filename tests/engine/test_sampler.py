import pytest
import torch

from doublesparse.engine.sampler import filter_probs, make_generator, sample
from doublesparse.engine.sampling_params import SamplingParams


def logits(B=4, V=50, seed=0):
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3


def gens(n, seed=1):
    return [make_generator(seed + i, "cpu") for i in range(n)]


def test_greedy_is_argmax():
    x = logits()
    out = sample(x, [SamplingParams(temperature=0.0)] * 4, [None] * 4)
    assert torch.equal(out, x.argmax(-1))
    assert torch.equal(sample(x, [SamplingParams(top_k=1)] * 4, gens(4)), x.argmax(-1))


def test_tiny_top_p_is_argmax():
    x = logits()
    out = sample(x, [SamplingParams(temperature=1.0, top_p=1e-6)] * 4, gens(4))
    assert torch.equal(out, x.argmax(-1))


def test_seeded_reproducible_and_independent_of_batch():
    x = logits(B=3)
    ps = [SamplingParams(temperature=1.0, seed=i) for i in range(3)]
    a = sample(x, ps, gens(3))
    b = sample(x, ps, gens(3))
    assert torch.equal(a, b)
    # row 1 alone with its own generator gives the same token as in the batch
    alone = sample(x[1:2], ps[1:2], [make_generator(2, "cpu")])
    assert int(alone[0]) == int(a[1])


def test_top_k_restricts_support():
    x = logits(B=1, V=30)
    top3 = set(x[0].topk(3).indices.tolist())
    g = make_generator(0, "cpu")
    seen = {int(sample(x, [SamplingParams(top_k=3)], [g])[0]) for _ in range(200)}
    assert seen <= top3 and len(seen) > 1


def test_filter_probs_top_p_mass():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs, order = filter_probs(x, torch.ones(1), torch.tensor([0.7]), torch.zeros(1, dtype=torch.long))
    assert torch.allclose(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert order[0].tolist() == [0, 1, 2, 3]


def test_temperature_matches_distribution():
    x = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    g = make_generator(0, "cpu")
    n = 3000
    counts = torch.bincount(torch.stack([sample(x, [SamplingParams()], [g])[0] for _ in range(n)]),
                            minlength=3).float() / n
    assert torch.allclose(counts, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


@pytest.mark.parametrize("kw,msg", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(max_new_tokens=1.5), "max_new_tokens"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(prompt_logprobs=True), "prompt_logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(ds_heavy_token_num=0), "ds_heavy_token_num"),
])
def test_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_from_any():
    p = SamplingParams.from_any({"max_new_tokens": 5, "stop": "x", "temperature": 0})
    assert p.max_new_tokens == 5 and p.stop == ("x",) and p.greedy
    with pytest.raises(ValueError, match="unknown"):
        SamplingParams.from_any({"max_tokens": 5})
    assert SamplingParams.from_any(None) == SamplingParams()
