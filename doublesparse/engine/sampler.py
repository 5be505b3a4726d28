"""Token sampling: greedy, temperature, top-k, top-p; seeded per request with torch.Generator.

The filtering is batched over rows; only the final draw loops over the sampled rows, because each
request owns its generator (so a request's tokens do not depend on what it is batched with).
"""

from __future__ import annotations

import torch

from .sampling_params import SamplingParams
from .transfer import to_device


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF)
    return g


def filter_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 top_k: torch.Tensor):
    """Sorted, renormalised probabilities after temperature / top-k / top-p.

    logits [B, V] float32; temperature, top_p [B] float32; top_k [B] int64 (<= 0: off).
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
    probs, order = filter_probs(logits[idx], *sub)
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
