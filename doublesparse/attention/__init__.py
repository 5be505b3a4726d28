"""Attention backends and their registry (the one place that maps names to classes)."""

from __future__ import annotations

from .base import AttentionBackend, PrefillMeta, PrefillSegment
from .dense import DenseBackend
from .double_sparsity import DoubleSparsityBackend, DSParams

# name -> (class, forced ops impl or None). "torch" is the pure-PyTorch path of either backend.
BACKENDS: dict[str, type[AttentionBackend]] = {
    "dense": DenseBackend,
    "double_sparsity": DoubleSparsityBackend,
}


def create_backend(name: str, *, use_double_sparsity: bool, ds: DSParams | None = None, **kwargs) -> AttentionBackend:
    """Build a backend by registry name ("dense" | "double_sparsity" | "torch").

    kwargs go to the backend constructor (memory, num_q_heads, head_dim, sm_scale, workspace, channels,
    tuning).
    """
    if name == "torch":
        kwargs["impl"] = "torch"
        name = "double_sparsity" if use_double_sparsity else "dense"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(BACKENDS) + ['torch']}")
    cls = BACKENDS[name]
    if cls is DoubleSparsityBackend:
        return cls(ds=ds, **kwargs)
    return cls(**kwargs)


__all__ = ["AttentionBackend", "PrefillMeta", "PrefillSegment", "DenseBackend", "DoubleSparsityBackend",
           "DSParams", "BACKENDS", "create_backend"]
