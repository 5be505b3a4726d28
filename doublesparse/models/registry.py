"""The one place that maps an architecture key (``ModelConfig.architecture``) to the class
implementing it; loaders and the engine go through :func:`model_class`."""

from __future__ import annotations

from .llama import LlamaModel
from .mla import DeepseekV2Model
from .moe_model import MoEModel

MODEL_REGISTRY: dict[str, type] = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": LlamaModel,
    "mixtral": MoEModel,
    "qwen3_moe": MoEModel,
    "deepseek_v2": DeepseekV2Model,
}


def model_class(architecture: str) -> type:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported model architecture {architecture!r}; "
                         f"supported: {', '.join(sorted(MODEL_REGISTRY))}") from None
