"""Model definitions and loaders.

The registry below is the one place that maps an architecture key (``ModelConfig.architecture``)
to the class implementing it; loaders and the engine go through :func:`model_class`.
"""

from __future__ import annotations

from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .llama import LlamaModel

MODEL_REGISTRY: dict[str, type] = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": LlamaModel,
}


def model_class(architecture: str) -> type:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported model architecture {architecture!r}; "
                         f"supported: {', '.join(sorted(MODEL_REGISTRY))}") from None


from .loader import load_config, load_model, load_tokenizer, read_chat_template, shipped_configs  # noqa: E402
from .simple_attention import (  # noqa: E402
    CachedCausalAttention, CausalAttention, SimpleBatch, forward_sequence, greedy_generate,
)

__all__ = [
    "MODEL_REGISTRY", "SUPPORTED_ARCHITECTURES", "ModelConfig", "LlamaModel", "model_class",
    "load_model", "load_config", "load_tokenizer", "read_chat_template", "shipped_configs",
    "CausalAttention", "CachedCausalAttention", "SimpleBatch", "forward_sequence", "greedy_generate",
]
