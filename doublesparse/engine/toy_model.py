"""A tiny Llama-shaped model and a character tokenizer obeying the models' interface, so the engine
(and its tests / benchmarks) run without any checkpoint. Not a real model: random weights.

``model(input_ids [T] int64, positions [T] int64, batch) -> logits [N, vocab] float32`` where
attention goes through ``batch.attn.forward(layer_id, q, k, v, batch)`` with post-RoPE q/k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ToyConfig:
    architecture: str = "llama"
    name: str = "toy"
    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 1024
    eos_token_ids: tuple[int, ...] = (0,)
    bos_token_id: int | None = None
    tie_word_embeddings: bool = False
    sliding_window: int | None = None


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE on x [T, H, D]."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    ang = positions.float()[:, None] * inv[None, :]                     # [T, D/2]
    cos, sin = ang.cos()[:, None, :].to(x.dtype), ang.sin()[:, None, :].to(x.dtype)
    a, b = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class _Attn(nn.Module):
    def __init__(self, c: ToyConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_q_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_q_heads * c.head_dim, c.hidden_size, bias=False)


class _Layer(nn.Module):
    def __init__(self, c: ToyConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = nn.RMSNorm(c.hidden_size)
        self.self_attn = _Attn(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(c.hidden_size, 2 * c.hidden_size), nn.SiLU(),
                                 nn.Linear(2 * c.hidden_size, c.hidden_size))

    def forward(self, x, positions, batch):
        c, a = self.self_attn.c, self.self_attn
        h = self.input_layernorm(x)
        T = x.shape[0]
        q = _rope(a.q_proj(h).view(T, c.num_q_heads, c.head_dim), positions)
        k = _rope(a.k_proj(h).view(T, c.num_kv_heads, c.head_dim), positions)
        v = a.v_proj(h).view(T, c.num_kv_heads, c.head_dim)
        o = batch.attn.forward(self.layer_id, q, k, v, batch)
        x = x + a.o_proj(o.reshape(T, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class ToyModel(nn.Module):
    def __init__(self, config: ToyConfig = ToyConfig(), seed: int = 0, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.config = config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(_Layer(config, i) for i in range(config.num_layers))
            self.norm = nn.RMSNorm(config.hidden_size)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            with torch.no_grad():  # sharper logits than default init: greedy ties are unlikely
                self.lm_head.weight.mul_(8.0)
        self.to(device=device, dtype=dtype)

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    @property
    def device(self):
        return self.embed_tokens.weight.device

    def forward(self, input_ids, positions, batch):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, batch)
        idx = getattr(batch, "logits_indices", None)
        if idx is not None:
            x = x.index_select(0, idx)
        return self.lm_head(self.norm(x)).float()


class CharTokenizer:
    """Printable-ASCII character tokenizer over the toy vocab: id = ord(c) (id 0 = EOS)."""

    eos_token_id = 0

    def __init__(self, vocab_size: int = 128):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [min(ord(ch), self.vocab_size - 1) or 1 for ch in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": self.encode(text)}
