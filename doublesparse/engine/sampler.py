"""Token sampling: greedy, temperature, top-k, top-p, min-p; seeded per request with
torch.Generator. Also the logits processors that run before it (repetition, frequency and
presence penalties) and the log-probabilities returned to clients.

The filtering is batched over rows; only the final draw loops over the sampled rows, because each
request owns its generator (so a request's tokens do not depend on what it is batched with).
"""

from __future__ import annotations

import torch

from .sampling_params import SamplingParams
from ..kernels.transfer import to_device


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF)
    return g


def filter_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 top_k: torch.Tensor, min_p: torch.Tensor | None = None):
    """Sorted, renormalised probabilities after temperature / top-k / top-p / min-p.

    logits [B, V] float32; temperature, top_p [B] float32; top_k [B] int64 (<= 0: off);
    min_p [B] float32 or None (0: off).
    Returns (probs [B, V] float32 in descending-logit order, order [B, V] int64 token ids).
    """
    x = logits.float() / temperature.clamp_min(1e-6)[:, None]
    vals, order = torch.sort(x, dim=-1, descending=True)
    probs = torch.softmax(vals, dim=-1)
    V = probs.shape[-1]
    rank = torch.arange(V, device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))
    drop = rank >= k[:, None]
    # top-p keeps the smallest prefix whose mass reaches p: drop a token when the mass before it
    # already does (the first token always survives)
    before = probs.cumsum(-1) - probs
    drop |= before >= top_p[:, None]
    if min_p is not None:
        drop |= probs < min_p[:, None] * probs[:, :1]
    # the most likely token always survives, so no row can be left with zero mass (and NaNs)
    drop[:, 0] = False
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    return probs, order


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """Next token per row: logits [B, V] float32 -> [B] int64 (on logits' device)."""
    out = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    dev = logits.device
    idx = to_device(torch.tensor(rows), dev)
    sub = params_tensors([params[i] for i in rows], dev)
    min_p = None
    if any(params[i].min_p > 0 for i in rows):
        min_p = to_device(torch.tensor([float(params[i].min_p) for i in rows]), dev)
    probs, order = filter_probs(logits[idx], *sub, min_p=min_p)
    picks = []
    for j, i in enumerate(rows):
        picks.append(torch.multinomial(probs[j], 1, generator=generators[i]))
    chosen = torch.gather(order, 1, torch.stack(picks))          # [n, 1]
    out[idx] = chosen[:, 0]
    return out


def params_tensors(params: list[SamplingParams], device) -> tuple[torch.Tensor, ...]:
    t = torch.tensor([float(p.temperature) for p in params], dtype=torch.float32)
    p = torch.tensor([float(p.top_p) for p in params], dtype=torch.float32)
    k = torch.tensor([int(p.top_k or 0) for p in params], dtype=torch.int64)
    return to_device(t, device), to_device(p, device), to_device(k, device)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> torch.Tensor:
    """Penalised logits (a new tensor).

    logits [n, V] float32; counts [n, V] float32: how often each token was generated so far;
    prompt_mask [n, V] bool: tokens of the prompt; repetition, frequency, presence [n] float32.
    The repetition penalty covers prompt and output tokens (as in HF and vLLM), the OpenAI
    frequency and presence penalties only output tokens.
    """
    x = logits.float()
    seen = prompt_mask | (counts > 0)
    r = repetition[:, None]
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    return x - counts * frequency[:, None] - (counts > 0).float() * presence[:, None]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """The model's log-probabilities of the sampled tokens and of the k most likely ones.

    logits [n, V] (raw: before penalties, temperature and masks); tokens [n] int64.
    Returns [n, 1 + 2k] float64: the sampled token's logprob, the top-k logprobs (descending),
    then the top-k token ids (exact in float64), packed so one copy brings them to the host.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    parts = [lp.gather(1, tokens[:, None]).double()]
    if k:
        vals, ids = lp.topk(k, dim=-1)
        parts += [vals.double(), ids.double()]
    return torch.cat(parts, dim=1)
