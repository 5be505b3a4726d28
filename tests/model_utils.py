"""Full-forward references for engine and server tests: a model run once over a whole sequence
with plain causal attention, no pools and no decode path."""

from __future__ import annotations


import torch

from doublesparse.attention.batch import ForwardBatch
import torch.nn.functional as F


class CausalAttention:
    """The attention backend of a full forward: causal SDPA over the sequence's own q/k/v
    ([T, H, D] each; grouped KV heads expanded by SDPA)."""

    def forward(self, layer_id, q, k, v, batch):
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=True, enable_gqa=True)
        return o.transpose(0, 1)


@torch.inference_mode()
def full_logprobs(model, ids: list[int], exact: bool = False) -> torch.Tensor:
    """log_softmax of one full causal forward: [len(ids), V] float64 (``exact``: every row from
    the LM head's own weight, as prompt logprobs are, not a CPU model's bf16 copy)."""
    b = ForwardBatch(attn=CausalAttention(), exact_logits_rows=tuple(range(len(ids))) if exact else ())
    logits = model(torch.tensor(ids), torch.arange(len(ids)), b)
    return torch.log_softmax(logits.double(), dim=-1)
