"""Hyper-parameters of the mixture-of-experts and multi-head latent attention (MLA) families.

:class:`~doublesparse.models.config.ModelConfig` carries them as two optional parts, ``moe`` and
``mla``: Mixtral and Qwen3-MoE are Llama-family attention with a routed MLP (``moe`` only);
DeepSeek-V2 has both. For an MLA model the ModelConfig's attention fields describe what the KV
pool holds, one latent per token: ``num_kv_heads`` 1 and ``head_dim`` = ``kv_lora_rank +
qk_rope_head_dim`` (576 for DeepSeek-V2), with every query head attending over it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# HF ``architectures`` entry -> our architecture key, for the families defined here.
MOE_HF_ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
}
TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts of the MoE layers (softmax router, top-k).

    ``dense_layers``: indices of layers with a plain gated MLP of the model's
    ``intermediate_size`` instead (DeepSeek's ``first_k_dense_replace``, Qwen's ``mlp_only_layers``).
    ``norm_topk_prob``: renormalise the k chosen probabilities to sum 1 (Mixtral always does).
    ``num_groups`` / ``topk_groups``: group-limited routing (experts in ``num_groups`` equal groups;
    only the ``topk_groups`` groups with the best single expert are eligible).
    ``num_shared_experts``: always-on experts, run as one gated MLP of that many times
    ``intermediate_size``. ``hf_style``: checkpoint tensor names, "mixtral" (block_sparse_moe,
    w1/w3/w2) or "mlp" (mlp.experts.{e}.gate_proj/up_proj/down_proj).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    topk_method: str = "greedy"
    num_groups: int = 1
    topk_groups: int = 1
    dense_layers: tuple[int, ...] = ()
    hf_style: str = "mlp"
    router_fp32: bool = False  # router GEMM in float32 (DeepSeek) rather than the model dtype

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"unsupported topk_method {self.topk_method!r} (supported: {', '.join(TOPK_METHODS)})")
        if self.num_experts % self.num_groups:
            raise ValueError(f"n_group={self.num_groups} does not divide num_experts={self.num_experts}")

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id not in self.dense_layers


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2): queries through an optional low-rank ``q_lora_rank``;
    keys/values through a ``kv_lora_rank`` latent plus one shared ``qk_rope_head_dim`` RoPE key.
    YaRN fields are None/0 for plain RoPE."""

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    yarn_factor: float | None = None
    yarn_original_max_position: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 0.0
    yarn_mscale_all_dim: float = 0.0

    @property
    def latent_dim(self) -> int:
        """Width of one cached latent row: compressed KV then the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2``."""
        s = self.qk_head_dim ** -0.5
        if self.yarn_factor and self.yarn_mscale_all_dim:
            m = yarn_mscale(self.yarn_factor, self.yarn_mscale_all_dim)
            s *= m * m
        return s


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def moe_from_hf(arch: str, d: dict[str, Any]) -> MoEConfig:
    """The routed-expert part of a Mixtral / Qwen3-MoE / DeepSeek-V2 ``config.json``."""
    n_layers = d["num_hidden_layers"]
    if arch == "mixtral":
        return MoEConfig(num_experts=d["num_local_experts"], top_k=d["num_experts_per_tok"],
                         intermediate_size=d["intermediate_size"], norm_topk_prob=True, hf_style="mixtral")
    if arch == "qwen3_moe":
        step = d.get("decoder_sparse_step", 1) or 1
        only = set(d.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(n_layers) if i in only or (i + 1) % step)
        return MoEConfig(num_experts=d.get("num_experts") or d["num_local_experts"], top_k=d["num_experts_per_tok"],
                         intermediate_size=d["moe_intermediate_size"],
                         norm_topk_prob=bool(d.get("norm_topk_prob", False)), dense_layers=dense)
    # deepseek_v2
    if d.get("scoring_func", "softmax") != "softmax":
        raise ValueError(f"unsupported scoring_func {d['scoring_func']!r} (supported: softmax)")
    first_dense = d.get("first_k_dense_replace", 0) or 0
    freq = d.get("moe_layer_freq", 1) or 1
    dense = tuple(i for i in range(n_layers) if i < first_dense or i % freq)
    return MoEConfig(num_experts=d["n_routed_experts"], top_k=d["num_experts_per_tok"],
                     intermediate_size=d["moe_intermediate_size"],
                     norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                     routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                     num_shared_experts=d.get("n_shared_experts") or 0,
                     topk_method=d.get("topk_method", "greedy"), num_groups=d.get("n_group") or 1,
                     topk_groups=d.get("topk_group") or 1, dense_layers=dense, router_fp32=True)


def mla_from_hf(d: dict[str, Any]) -> MLAConfig:
    """The attention part of a DeepSeek-V2 ``config.json`` (``rope_scaling`` or, since
    transformers 5, ``rope_parameters``: plain or YaRN)."""
    rs = d.get("rope_scaling") or d.get("rope_parameters") or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    yarn: dict[str, Any] = {}
    if kind == "yarn":
        yarn = {"yarn_factor": float(rs["factor"]),
                "yarn_original_max_position": int(rs["original_max_position_embeddings"]),
                "yarn_beta_fast": float(rs.get("beta_fast") or 32),
                "yarn_beta_slow": float(rs.get("beta_slow") or 1),
                "yarn_mscale": float(rs.get("mscale") or 0),
                "yarn_mscale_all_dim": float(rs.get("mscale_all_dim") or 0)}
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r} for deepseek_v2 (supported: yarn)")
    return MLAConfig(kv_lora_rank=d["kv_lora_rank"], q_lora_rank=d.get("q_lora_rank"),
                     qk_nope_head_dim=d["qk_nope_head_dim"], qk_rope_head_dim=d["qk_rope_head_dim"],
                     v_head_dim=d["v_head_dim"], **yarn)


def family_num_params(c) -> int:
    """Parameter count of a ModelConfig with ``moe`` and/or ``mla`` (tied embeddings once)."""
    h, moe, mla = c.hidden_size, c.moe, c.mla
    if mla is None:
        attn = h * c.qkv_size + c.q_size * h + (c.qkv_size if c.attention_bias else 0)
        attn += 2 * c.head_dim if c.qk_norm else 0
    else:
        nh = c.num_q_heads
        q = h * nh * mla.qk_head_dim if mla.q_lora_rank is None else \
            h * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * nh * mla.qk_head_dim
        attn = q + h * mla.latent_dim + mla.kv_lora_rank
        attn += mla.kv_lora_rank * nh * (mla.qk_nope_head_dim + mla.v_head_dim) + nh * mla.v_head_dim * h
    total = 0
    for i in range(c.num_layers):
        total += attn + 2 * h
        if moe is None or not moe.is_moe_layer(i):
            total += 3 * h * c.intermediate_size
        else:
            total += moe.num_experts * (3 * h * moe.intermediate_size + h)
            total += 3 * h * moe.intermediate_size * moe.num_shared_experts
    return total + c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + h
