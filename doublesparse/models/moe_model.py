"""Mixtral and Qwen3-MoE: the Llama-family decoder with a routed-expert MLP (:mod:`.moe`).

Attention is :class:`~doublesparse.models.llama.LlamaAttention` unchanged (GQA, Qwen3's q/k norm),
so every attention backend, Double Sparsity included, runs on these models as on Llama. Layers
listed in ``config.moe.dense_layers`` keep a plain gated MLP. The forward is LlamaModel's.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .layers import GatedMLP, RMSNorm, RotaryEmbedding
from .llama import LlamaAttention, LlamaDecoderLayer, LlamaModel, init_decoder
from .moe import SparseMoE


def moe_or_dense_mlp(config: ModelConfig, layer_id: int, device=None, dtype=None) -> nn.Module:
    """The layer's MLP: :class:`SparseMoE` on an MoE layer, else a gated MLP of ``intermediate_size``."""
    c = config
    if c.moe is not None and c.moe.is_moe_layer(layer_id):
        return SparseMoE(c.hidden_size, c.moe, device=device, dtype=dtype)
    return GatedMLP(c.hidden_size, c.intermediate_size, device=device, dtype=dtype)


class MoEDecoderLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer with ``mlp`` from :func:`moe_or_dense_mlp` (same forward)."""

    def __init__(self, config: ModelConfig, layer_id: int, device=None, dtype=None):
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: it would allocate a dense MLP first
        c = config
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device, dtype=dtype)
        self.attn = LlamaAttention(c, layer_id, device=device, dtype=dtype)
        self.post_attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device, dtype=dtype)
        self.mlp = moe_or_dense_mlp(c, layer_id, device=device, dtype=dtype)


class MoEModel(LlamaModel):
    """Causal LM of the Mixtral / Qwen3-MoE families; interface and forward as :class:`LlamaModel`.

    Parameter names: LlamaModel's, with ``layers.{i}.mlp`` on MoE layers holding
    ``gate.weight [E, H]``, ``w13 [E * 2I, H]`` and ``w2 [E * H, I]`` (see :mod:`.moe`).
    """

    def __init__(self, config: ModelConfig, device=None, dtype=torch.float32, max_positions: int | None = None):
        nn.Module.__init__(self)
        if config.moe is None:
            raise ValueError(f"{config.name}: MoEModel needs a config with routed experts")
        init_decoder(self, config, MoEDecoderLayer, device, dtype,
                     RotaryEmbedding(config, max_positions=max_positions, device=device))
