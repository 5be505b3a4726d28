"""doublesparse: long-context LLM inference with Double Sparsity decoding."""

__version__ = "0.1.0"
