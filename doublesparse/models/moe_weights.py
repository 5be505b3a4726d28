"""HF checkpoint tensor names of the MoE / MLA families -> our parameters (row ranges).

Same contract as :func:`doublesparse.models.weights.hf_weight_map`, which hands configs with
``moe`` or ``mla`` to :func:`family_weight_map`. Experts are read from the per-expert layout that
checkpoints (and transformers' ``save_pretrained``) use: Mixtral's
``block_sparse_moe.experts.{e}.w1/w3/w2`` and the ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` of
Qwen3-MoE and DeepSeek-V2; each lands in its rows of the stacked ``w13`` / ``w2``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .config import ModelConfig

WeightMap = dict[str, tuple[str, "int | None", "int | None"]]


def _mla_attention(c: ModelConfig, hf: str, ours: str) -> WeightMap:
    mla = c.mla
    m: WeightMap = {}
    if mla.q_lora_rank is None:
        m[hf + "self_attn.q_proj.weight"] = (ours + "attn.q_proj.weight", None, None)
    else:
        m[hf + "self_attn.q_a_proj.weight"] = (ours + "attn.q_a_proj.weight", None, None)
        m[hf + "self_attn.q_a_layernorm.weight"] = (ours + "attn.q_a_norm.weight", None, None)
        m[hf + "self_attn.q_b_proj.weight"] = (ours + "attn.q_b_proj.weight", None, None)
    for a, b in (("kv_a_proj_with_mqa", "kv_a_proj"), ("kv_a_layernorm", "kv_a_norm"),
                 ("kv_b_proj", "kv_b_proj"), ("o_proj", "o_proj")):
        m[hf + f"self_attn.{a}.weight"] = (ours + f"attn.{b}.weight", None, None)
    return m


def _experts(c: ModelConfig, hf: str, ours: str) -> WeightMap:
    moe, h = c.moe, c.hidden_size
    inter = moe.intermediate_size
    m: WeightMap = {}
    mixtral = moe.hf_style == "mixtral"
    block = hf + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    m[block + "gate.weight"] = (ours + "mlp.gate.weight", None, None)
    for e in range(moe.num_experts):
        g, u, d = (f"{block}experts.{e}.{n}.weight" for n in names)
        m[g] = (ours + "mlp.w13", 2 * e * inter, (2 * e + 1) * inter)
        m[u] = (ours + "mlp.w13", (2 * e + 1) * inter, (2 * e + 2) * inter)
        m[d] = (ours + "mlp.w2", e * h, (e + 1) * h)
    if moe.num_shared_experts:
        si = inter * moe.num_shared_experts
        m[block + "shared_experts.gate_proj.weight"] = (ours + "mlp.shared.gate_up_proj.weight", 0, si)
        m[block + "shared_experts.up_proj.weight"] = (ours + "mlp.shared.gate_up_proj.weight", si, 2 * si)
        m[block + "shared_experts.down_proj.weight"] = (ours + "mlp.shared.down_proj.weight", None, None)
    return m


def family_weight_map(c: ModelConfig, llama_map: Callable[[ModelConfig], WeightMap]) -> WeightMap:
    """HF tensor name -> (our parameter, first row, end row) for a config with ``moe`` / ``mla``;
    ``llama_map``: the Llama family's map (weights.hf_weight_map), whose differences these are."""
    # The Llama-family map (embeddings, norms, GQA attention, dense MLPs), then the differences.
    base = dataclasses.replace(c, moe=None, mla=None)
    if c.mla is not None:  # the placeholder GQA shape of an MLA config is never loaded
        base = dataclasses.replace(base, num_kv_heads=c.num_q_heads, head_dim=2)
    m = llama_map(base)
    for i in range(c.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        if c.mla is not None:
            for key in [k for k in m if k.startswith(hf + "self_attn.")]:
                del m[key]
            m.update(_mla_attention(c, hf, ours))
        if c.moe is not None and c.moe.is_moe_layer(i):
            for key in [k for k in m if k.startswith(hf + "mlp.")]:
                del m[key]
            m.update(_experts(c, hf, ours))
    return m
