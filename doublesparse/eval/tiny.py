"""A tiny random Llama-like model and a byte tokenizer obeying the models-package interface.

For tests and CI smoke runs of calibration and eval, without the real checkpoint:
``logits = model(input_ids [T], positions [T], batch)``; each layer calls
``batch.attn.forward(layer_id, q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D], batch) -> [T,Hq,D]`` with q/k
after (rotate-half) RoPE, and the logits of rows ``batch.logits_indices`` (None: all) are returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TinyConfig:
    name: str = "tiny-llama"
    vocab_size: int = 260          # 256 bytes + 4 specials
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = (257,)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of ``x [T, H, D]`` at ``positions [T]``."""
    D = x.shape[-1]
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float32, device=x.device) / D)
    ang = positions.float()[:, None] * inv[None]                          # [T, D/2]
    cos, sin = ang.cos()[:, None].repeat(1, 1, 2), ang.sin()[:, None].repeat(1, 1, 2)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class _Layer(nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        h, d = c.hidden_size, c.head_dim
        self.input_layernorm = nn.RMSNorm(h)
        self.q_proj = nn.Linear(h, c.num_q_heads * d, bias=False)
        self.k_proj = nn.Linear(h, c.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, c.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_q_heads * d, h, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(h)
        self.up = nn.Linear(h, c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, h, bias=False)


class TinyModel(nn.Module):
    def __init__(self, config: TinyConfig = TinyConfig(), seed: int = 0):
        super().__init__()
        self.config = config
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.6 / p.shape[1] ** 0.5)
            # uneven channel scales so that channel rankings are meaningful, not noise
            for lyr in self.layers:
                s = torch.rand(config.num_kv_heads * config.head_dim, 1, generator=g) * 2 + 0.1
                lyr.k_proj.weight.mul_(s)

    def forward(self, input_ids, positions, batch):
        c = self.config
        x = self.embed(input_ids)
        T = x.shape[0]
        for i, lyr in enumerate(self.layers):
            h = lyr.input_layernorm(x)
            q = rope(lyr.q_proj(h).view(T, c.num_q_heads, c.head_dim), positions, c.rope_theta)
            k = rope(lyr.k_proj(h).view(T, c.num_kv_heads, c.head_dim), positions, c.rope_theta)
            v = lyr.v_proj(h).view(T, c.num_kv_heads, c.head_dim)
            o = batch.attn.forward(i, q, k, v, batch)
            x = x + lyr.o_proj(o.reshape(T, -1).to(x.dtype))
            x = x + lyr.down(torch.nn.functional.silu(lyr.up(lyr.post_attention_layernorm(x))))
        idx = getattr(batch, "logits_indices", None)
        x = self.norm(x if idx is None else x[idx.long()])
        return self.lm_head(x).float()


class ByteTokenizer:
    """UTF-8 bytes as tokens; ids 256.. are specials. ``encode``/``decode`` like ours."""

    bos_token_id, eos_token_id = 256, 257

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")
