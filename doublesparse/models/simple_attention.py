"""A cache-less dense attention backend for one sequence, for tests and calibration.

Real serving uses the paged / Double-Sparsity backends; this one exists so that a model can be run
end to end with nothing but PyTorch: every call is a full prefill of a single causal sequence.
To record q/k statistics (calibration), wrap it and look at ``q``/``k`` in ``forward``: they are
exactly what a serving backend would receive (after bias, qk-norm and RoPE).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..attention.batch import ForwardBatch


class CausalAttention:
    """Dense causal softmax attention over the T tokens of the call (one sequence, no KV cache).

    ``sliding_window`` (tokens, Mistral-style: each query sees itself and the previous
    ``window - 1`` keys) is optional; by default attention is fully causal.
    """

    def __init__(self, sliding_window: int | None = None, scale: float | None = None):
        self.sliding_window = sliding_window
        self.scale = scale

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: Any = None) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] (any float dtype) -> [T, Hq, D] in q's dtype."""
        T = q.shape[0]
        # [1, H, T, D]: with 3-D inputs CPU SDPA skips its fused kernel and builds [H, T, T] scores.
        qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
        if self.sliding_window is None or self.sliding_window >= T:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            i = torch.arange(T, device=q.device)
            rel = i[:, None] - i[None, :]
            mask = (rel >= 0) & (rel < self.sliding_window)
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return out[0].transpose(0, 1)


def forward_sequence(model, input_ids: torch.Tensor, attn: Any = None, last_only: bool = False) -> torch.Tensor:
    """Full causal forward of one sequence. input_ids: [T] int64 -> logits [T or 1, vocab] float32."""
    input_ids = input_ids.to(model.device)
    T = input_ids.shape[0]
    positions = torch.arange(T, device=input_ids.device)
    idx = torch.tensor([T - 1], device=input_ids.device) if last_only else None
    if attn is None:
        attn = CausalAttention(sliding_window=model.config.sliding_window)
    return model(input_ids, positions, ForwardBatch(attn=attn, logits_indices=idx))


class CachedCausalAttention(CausalAttention):
    """CausalAttention for one sequence that keeps a growing per-layer KV cache (prefill, then decode).

    Calls must present the sequence's tokens in order; each call's queries sit after everything
    cached so far. Shapes are read on the host, so this backend is for tests, not CUDA graphs.
    """

    def __init__(self, num_layers: int, sliding_window: int | None = None, scale: float | None = None):
        super().__init__(sliding_window, scale)
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def forward(self, layer_id, q, k, v, batch=None):
        if self.k[layer_id] is not None:
            k = torch.cat([self.k[layer_id], k])
            v = torch.cat([self.v[layer_id], v])
        self.k[layer_id], self.v[layer_id] = k, v
        past = k.shape[0] - q.shape[0]
        if past == 0:
            return super().forward(layer_id, q, k, v, batch)
        qi = torch.arange(past, k.shape[0], device=q.device)[:, None]  # absolute query positions
        kj = torch.arange(k.shape[0], device=q.device)[None, :]
        mask = kj <= qi
        if self.sliding_window is not None:
            mask &= qi - kj < self.sliding_window
        qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))  # 4-D: see CausalAttention
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return out[0].transpose(0, 1)


@torch.inference_mode()
def greedy_generate(model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_ids=(),
                    use_cache: bool = True) -> torch.Tensor:
    """Greedy decoding of one sequence. input_ids: [T] int64 -> new tokens [<= max_new_tokens] int64.

    ``use_cache=False`` recomputes the whole sequence every step (O(n^2), the simplest reference).
    """
    ids = input_ids.to(model.device)
    cache = CachedCausalAttention(model.config.num_layers, model.config.sliding_window) if use_cache else None
    step_ids, start = ids, 0
    new = []
    for _ in range(max_new_tokens):
        if cache is None:
            logits = forward_sequence(model, ids, last_only=True)
        else:
            n = step_ids.shape[0]
            pos = torch.arange(start, start + n, device=ids.device)
            last = torch.tensor([n - 1], device=ids.device)
            logits = model(step_ids, pos, ForwardBatch(attn=cache, logits_indices=last))
            start += n
        tok = logits[0].argmax()
        new.append(tok)
        ids = torch.cat([ids, tok.view(1)])
        step_ids = tok.view(1)
        if int(tok) in eos_token_ids:
            break
    return torch.stack(new) if new else ids.new_empty(0)


def causal_attention(q, k, v, sm_scale: float | None = None):
    """Causal prefill of one sequence: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]``.

    The inputs get a batch dim (``[1, H, T, D]``) because on CPU PyTorch only takes its fused
    flash kernel for 4-D inputs; 3-D ones fall back to the math path, which materialises the
    ``[Hq, T, T]`` scores (measured on 2 cores, SmolLM2 shapes, T = 2048: 0.39 s vs 0.06 s per
    layer, which was ~70 % of calibration time).
    """
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k.to(q.dtype), v.to(q.dtype)))
    o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=sm_scale,
                                                         enable_gqa=True)
    return o[0].transpose(0, 1)


class FastCausal:
    """Plain causal attention backend (no KV cache, no sliding window), see :func:`causal_attention`."""

    def forward(self, layer_id, q, k, v, batch):
        return causal_attention(q, k, v)

    __call__ = forward


def plain_backend():
    """The plain causal backend calibration and evaluation delegate attention to (k and v cast to
    q's dtype; no sliding window)."""
    return FastCausal()
