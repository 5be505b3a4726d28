"""Model definitions and loaders (architecture -> class: :mod:`doublesparse.models.registry`)."""

from __future__ import annotations

from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .llama import LlamaModel
from .mla import DeepseekV2Model
from .moe_model import MoEModel
from .loader import load_config, load_model, load_tokenizer, read_chat_template, shipped_configs
from .registry import MODEL_REGISTRY, model_class
from .simple_attention import (
    CachedCausalAttention, CausalAttention, forward_sequence, greedy_generate,
)

__all__ = [
    "MODEL_REGISTRY", "SUPPORTED_ARCHITECTURES", "ModelConfig", "LlamaModel", "MoEModel", "DeepseekV2Model",
    "model_class",
    "load_model", "load_config", "load_tokenizer", "read_chat_template", "shipped_configs",
    "CausalAttention", "CachedCausalAttention", "forward_sequence", "greedy_generate",
]
