"""DeepSeek-V2 / V2-Lite: multi-head latent attention (MLA) + routed and shared experts.

Attention runs in the absorbed form for prefill and decode alike: the cache holds one latent row
per token, ``[c_kv (kv_lora_rank) | k_rope (qk_rope_head_dim)]`` (576 wide for DeepSeek-V2),
shared by all heads, so to the attention backend the model is MQA with one KV head of
``head_dim = 576`` whose values are the same rows (the backend's K and V pools may be one tensor,
engine/memory.py). Per head, the nope query is pulled into latent space through W_UK (the key
half of ``kv_b_proj``), ``q = [q_nope W_UK | rope(q_rope)]``, and the attention output's first
``kv_lora_rank`` columns are pushed out through W_UV: exact, and decode reads 576 values per token
instead of 2 x heads x 128. Double Sparsity therefore selects latent rows, one choice per token for
all heads, from labels that are channels of the latent.

Two details keep the backends unchanged: the query is pre-scaled so that their default softmax
scale ``head_dim ** -0.5`` yields MLA's (``qk_head_dim ** -0.5``, with YaRN's mscale^2); and the
checkpoint's interleaved RoPE pairs (2i, 2i+1) are reordered to the rotate-half layout
(i, i + d/2) before the rotation, for q and k alike, which leaves every score unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..kernels import ops
from ..kernels.latent import MLA_PROJ_MAX_TOKENS, latent_value_dim
from .config import ModelConfig
from .layers import Linear, RMSNorm, RotaryEmbedding, fused_impl
from .llama import LlamaDecoderLayer, LlamaModel, batch_tuning, init_decoder, is_decode
from .moe_config import MLAConfig, yarn_mscale
from .moe_model import moe_or_dense_mlp


def yarn_inv_freq(mla: MLAConfig, theta: float) -> tuple[torch.Tensor, float]:
    """(inverse frequencies ``[qk_rope_head_dim // 2]`` float32, cos/sin factor) of YaRN RoPE
    (plain RoPE and 1.0 without YaRN): high frequencies kept, low ones interpolated by ``factor``,
    a linear ramp between the bands set by ``beta_fast`` / ``beta_slow`` rotations."""
    d = mla.qk_rope_head_dim
    pos_freqs = theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    extra = 1.0 / pos_freqs
    if not mla.yarn_factor:
        return extra, 1.0
    f, orig = mla.yarn_factor, mla.yarn_original_max_position

    def dim_of(rotations):
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(math.floor(dim_of(mla.yarn_beta_fast)), 0)
    hi = min(math.ceil(dim_of(mla.yarn_beta_slow)), d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - lo) / ((hi - lo) or 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    inv = (extra / f) * (1 - keep) + extra * keep
    if mla.yarn_mscale and mla.yarn_mscale_all_dim:
        factor = yarn_mscale(f, mla.yarn_mscale) / yarn_mscale(f, mla.yarn_mscale_all_dim)
    else:
        factor = yarn_mscale(f)
    return inv, factor


class LatentRotaryEmbedding(RotaryEmbedding):
    """RoPE over the ``qk_rope_head_dim`` channels of an MLA config, YaRN-scaled (cos/sin carry
    YaRN's attention factor)."""

    def _table(self, device):
        c = self.config
        inv_freq, factor = yarn_inv_freq(c.mla, c.rope_theta)
        t = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        return (freqs.cos() * factor).to(device), (freqs.sin() * factor).to(device)


def _rotate_half_order(x: torch.Tensor) -> torch.Tensor:
    """[..., d] interleaved pairs (2i, 2i+1) -> [..., d] with pair i at (i, i + d/2), contiguous."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2).contiguous()


class MLAAttention(nn.Module):
    """q (optionally low-rank) and the latent from ``kv_a_proj``; absorbed attention through the
    backend; ``o_proj``. Parameters: ``q_proj`` or ``q_a_proj`` / ``q_a_norm`` / ``q_b_proj``,
    ``kv_a_proj [R + dr, H]``, ``kv_a_norm [R]``, ``kv_b_proj [heads * (dn + dv), R]``,
    ``o_proj [H, heads * dv]``."""

    def __init__(self, config: ModelConfig, layer_id: int, device=None, dtype=None):
        super().__init__()
        c, m = config, config.mla
        if c.attention_bias:
            raise ValueError(f"{c.name}: MLA with attention_bias is not supported")
        if m.kv_lora_rank > latent_value_dim(m.latent_dim):
            raise ValueError(f"{c.name}: kv_lora_rank {m.kv_lora_rank} + qk_rope_head_dim {m.qk_rope_head_dim} "
                             "is not a latent layout the decode kernels support")
        self.layer_id, self.mla, self.num_heads = layer_id, m, c.num_q_heads
        kw = {"device": device, "dtype": dtype}
        q_out = c.num_q_heads * m.qk_head_dim
        if m.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, q_out, **kw)
        else:
            self.q_a_proj = Linear(c.hidden_size, m.q_lora_rank, **kw)
            self.q_a_norm = RMSNorm(m.q_lora_rank, c.rms_norm_eps, **kw)
            self.q_b_proj = Linear(m.q_lora_rank, q_out, **kw)
        self.kv_a_proj = Linear(c.hidden_size, m.latent_dim, **kw)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, c.rms_norm_eps, **kw)
        self.kv_b_proj = Linear(m.kv_lora_rank, c.num_q_heads * (m.qk_nope_head_dim + m.v_head_dim), **kw)
        self.o_proj = Linear(c.num_q_heads * m.v_head_dim, c.hidden_size, **kw)
        # the backends scale scores by latent_dim ** -0.5; MLA wants softmax_scale
        self.q_scale = m.softmax_scale * math.sqrt(m.latent_dim)

    @staticmethod
    def _one_launch(x: torch.Tensor, tuning) -> str | None:
        """The ``ops`` impl of the one-launch steps around attention (``tuning.fused_mla``) for a
        step of x's tokens, or None: the separate ops (prefill chunks beyond MLA_PROJ_MAX_TOKENS)."""
        return fused_impl(tuning.fused_mla, x) if x.shape[0] <= MLA_PROJ_MAX_TOKENS else None

    def absorbed_query(self, x: torch.Tensor, positions: torch.Tensor, rope, tuning, decode: bool = False):
        """x: [T, H] -> (q [T, heads, latent_dim] pre-scaled, latent [T, 1, latent_dim]), model dtype."""
        T, m, nh = x.shape[0], self.mla, self.num_heads
        if m.q_lora_rank is None:
            q = self.q_proj(x, tuning, decode)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x, tuning, decode), tuning=tuning), tuning, decode)
        kv = self.kv_a_proj(x, tuning, decode)
        impl = self._one_launch(x, tuning)
        if impl is not None:  # one launch for all that follows
            w_uk = self.kv_b_proj.weight.view(nh, -1, m.kv_lora_rank)[:, :m.qk_nope_head_dim]
            return ops.mla_absorb(q.view(T, nh, m.qk_head_dim), kv, positions, rope.cos, rope.sin, w_uk,
                                  self.kv_a_norm.weight, self.kv_a_norm.eps, self.q_scale, impl=impl)
        q_nope, q_rope = q.view(T, nh, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c_kv, k_rope = kv.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_norm(c_kv.contiguous(), tuning=tuning)
        q_rope, k_rope = rope(positions, _rotate_half_order(q_rope), _rotate_half_order(k_rope)[:, None])
        w_uk = self.kv_b_proj.weight.view(nh, -1, m.kv_lora_rank)[:, :m.qk_nope_head_dim]   # [nh, dn, R]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)                    # [T, nh, R]
        q = torch.cat([q_lat, q_rope], dim=-1) * self.q_scale
        latent = torch.cat([c_kv[:, None], k_rope], dim=-1)                                 # [T, 1, R + dr]
        return q, latent

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope, batch) -> torch.Tensor:
        """x: [T, H] -> [T, H]; the backend sees q [T, heads, 576], k = v = latent [T, 1, 576]."""
        T, m, nh = x.shape[0], self.mla, self.num_heads
        tuning, decode = batch_tuning(batch), is_decode(batch)
        q, latent = self.absorbed_query(x, positions, rope, tuning, decode)
        out = batch.attn.forward(self.layer_id, q, latent, latent, batch)                   # [T, nh, 576]
        w_uv = self.kv_b_proj.weight.view(nh, -1, m.kv_lora_rank)[:, m.qk_nope_head_dim:]  # [nh, dv, R]
        impl = self._one_launch(x, tuning)
        if impl is not None:
            return self.o_proj(ops.mla_unabsorb(out, w_uv, impl=impl), tuning, decode)
        o = torch.bmm(out[..., :m.kv_lora_rank].transpose(0, 1), w_uv.transpose(1, 2))      # [nh, T, dv]
        return self.o_proj(o.transpose(0, 1).reshape(T, nh * m.v_head_dim), tuning, decode)


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    """Pre-norm decoder with MLA and an MoE (or, on ``dense_layers``, a dense) MLP."""

    def __init__(self, config: ModelConfig, layer_id: int, device=None, dtype=None):
        nn.Module.__init__(self)
        c = config
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device, dtype=dtype)
        self.attn = MLAAttention(c, layer_id, device=device, dtype=dtype)
        self.post_attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device, dtype=dtype)
        self.mlp = moe_or_dense_mlp(c, layer_id, device=device, dtype=dtype)


class DeepseekV2Model(LlamaModel):
    """DeepSeek-V2 family causal LM; interface and forward as :class:`LlamaModel`.

    ``config.num_kv_heads`` is 1 and ``config.head_dim`` the latent width: what the KV pool holds.
    """

    def __init__(self, config: ModelConfig, device=None, dtype=torch.float32, max_positions: int | None = None):
        nn.Module.__init__(self)
        if config.mla is None:
            raise ValueError(f"{config.name}: DeepseekV2Model needs an MLA config")
        init_decoder(self, config, DeepseekV2DecoderLayer, device, dtype,
                     LatentRotaryEmbedding(config, max_positions=max_positions, device=device))

    def default_heavy_channels(self, heavy_channel_num: int, channel_type: str = "qk") -> torch.Tensor:
        """Weight-based heavy latent channels ``[num_layers, 1, r]`` (models/mla_channels.py)."""
        from .mla_channels import mla_default_channels
        return mla_default_channels(self, heavy_channel_num, channel_type)
