"""doublesparse: long-context LLM inference with Double Sparsity decoding.

``doublesparse.Engine`` and ``doublesparse.SamplingParams`` are imported lazily, so that
``import doublesparse`` stays cheap (no torch/transformers import) for the CLI's ``--help``.
"""

from .version import __version__

__all__ = ["Engine", "SamplingParams", "__version__"]


def __getattr__(name):
    if name == "Engine":
        from .api import Engine
        return Engine
    if name == "SamplingParams":
        from .engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'doublesparse' has no attribute {name!r}")
