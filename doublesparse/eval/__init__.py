"""Evaluation of Double Sparsity decoding against dense: perplexity, next-token fidelity,
pass-key retrieval and per-layer attention fidelity, all through the real decode kernels."""

from .settings import DENSE, Setting, grid, improvements, preset

__all__ = ["DENSE", "Setting", "grid", "improvements", "preset"]
