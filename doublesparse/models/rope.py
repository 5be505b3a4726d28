"""Rotary position embedding (rotate-half / NeoX layout, as HF Llama), with linear and llama3 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..kernels import ops
from ..kernels.tuning import DEFAULT_TUNING, KernelTuning
from .config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32 after the config's rope scaling."""
    d = config.head_dim
    # float32 exponentiation, as HF does it, so cos/sin match the reference bit-for-bit at fp32.
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    kind = rs["rope_type"]
    if kind == "linear":
        return inv_freq / rs["factor"]
    if kind == "freq_factors":
        factors = torch.tensor(rs["factors"], dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"rope_freqs has {factors.numel()} entries, expected {inv_freq.numel()}")
        return inv_freq / factors
    if kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (beyond the original context) are slowed down by `factor`, short ones kept,
        # and the band in between is blended linearly in 1/wavelength.
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        middle = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(middle, blended, out)
    raise ValueError(f"unsupported rope_type {kind!r}")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q/k given absolute positions, from a cos/sin table precomputed on the device.

    The table is indexed with ``positions`` (a device gather, no host sync), so the op is safe
    inside CUDA graphs. Positions past ``max_positions`` are out of range: size the table for the
    longest sequence you will run.
    """

    def __init__(self, config: ModelConfig, max_positions: int | None = None, device=None):
        super().__init__()
        self.config = config
        self.max_positions = max_positions or config.max_position_embeddings
        cos, sin = self._table(device)
        # Not persistent: derived from the config, so it must not appear in state dicts.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _table(self, device):
        inv_freq = rope_inv_freq(self.config).to(device)
        t = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2] float32
        return freqs.cos(), freqs.sin()

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) would round the table too; rebuild it in float32 instead.
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:
            self.cos, self.sin = self._table(self.cos.device)
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [T] int64; q: [T, Hq, D]; k: [T, Hkv, D] -> rotated (q, k), same dtypes.

        The rotation is done in float32 and rounded once, which is at least as accurate as
        rotating in bf16.
        """
        # ops.rope can run one Triton launch on CUDA instead of the PyTorch form's ~20 tiny
        # launches per layer, which set the decode step time of small models (see ops.rope).
        return ops.rope(positions, q, k, self.cos, self.sin)

    def rotate_and_store(self, positions, q, k, v, targets, slots, return_k: bool = False,
                         impl: str = "auto", tuning: KernelTuning = DEFAULT_TUNING):
        """RoPE fused with the KV store (one launch on CUDA): rotated k, v and k's label go into
        the pools at ``slots`` [T] int64. targets: ``(k_cache, v_cache, label_cache, label_scale,
        channels, k_scale, v_scale)`` from ``AttentionBackend.store_targets`` (the label entries
        None: no labels; the scales: an fp8 pool's).
        q: [T, Hq, D]; k, v: [T, Hkv, D] (views of the qkv output are fine). Returns the rotated
        ``(q [T, Hq, D], k [T, Hkv, D] or None unless return_k)``, contiguous."""
        k_cache, v_cache, label_cache, label_scale, channels, k_scale, v_scale = targets
        return ops.rope_store(positions, q, k, v, self.cos, self.sin, k_cache, v_cache, slots,
                              label_cache, label_scale, channels, k_scale, v_scale, return_k=return_k,
                              impl=impl, tuning=tuning)
