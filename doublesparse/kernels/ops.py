"""Public kernel entry points. Each dispatches to the Triton kernels (CUDA tensors, or
``impl="triton"`` under ``TRITON_INTERPRET=1`` for tests) or to batched float32 PyTorch
(:mod:`.torch_ops`, the engine's pure-PyTorch CPU path, checked against the references).

The data layout is described in docs/design.md and in :mod:`doublesparse.kernels.reference`.
Every function here is free of host syncs on the Triton path, so decode can be captured in a
CUDA graph: lengths are read from device tensors and all buffers come from a :class:`DecodeWorkspace`.
"""

from __future__ import annotations

import torch

from . import reference as ref
from . import torch_ops
from .workspace import DecodeWorkspace

__all__ = ["DecodeWorkspace", "store_kv", "dense_decode", "ds_decode", "rope", "MODES"]

MODES = ref.MODES


def _use_triton(t: torch.Tensor, impl: str) -> bool:
    if impl == "auto":
        return t.is_cuda
    if impl == "triton":
        return True
    if impl == "torch":
        return False
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def store_kv(k_cache, v_cache, k, v, slots, label_cache=None, label_scale=None, channels=None,
             impl: str = "auto"):
    """Write new tokens into the pools, and their K label if ``label_cache`` is given.

    k_cache, v_cache: [S, Hkv, D]; k, v: [N, Hkv, D]; slots: [N] int32/int64;
    label_cache: [S, Hkv, r] bf16 | float8_e4m3fn; label_scale: [1] float32 (fp8);
    channels: [Hkv, r] int32.
    """
    if _use_triton(k, impl):
        from .triton.launch import store_kv as _store
        return _store(k_cache, v_cache, k, v, slots, label_cache, label_scale, channels)
    from .triton.launch import check_store_args
    check_store_args(k_cache, v_cache, k, v, slots, label_cache, label_scale, channels)
    ref.store_ref(k_cache, v_cache, label_cache, label_scale, k, v, slots, channels)


def dense_decode(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale: float,
                 ws: DecodeWorkspace | None = None, out=None, impl: str = "auto"):
    """Exact decode attention over each request's whole cache.

    q: [B, Hq, D]; returns (or fills ``out``) [B, Hq, D] in q's dtype.
    """
    if _use_triton(q, impl):
        from .triton.launch import dense_decode as _dense
        return _dense(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, ws, out)
    o = torch_ops.dense_decode(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale).to(q.dtype)
    if out is not None:
        out.copy_(o)
        return out
    return o


def ds_decode(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token, req_idx,
              seq_lens, sm_scale: float, heavy_token_num: int, mode: str = "group_max",
              threshold: int = 0, num_sink: int = 0, num_recent: int = 0,
              ws: DecodeWorkspace | None = None, out=None, impl: str = "auto"):
    """Double Sparsity decode: label scores -> top-k on device -> exact attention on those tokens.

    Requests with ``seq_len <= heavy_token_num`` or ``seq_len < threshold`` decode densely in the
    same launches (decided on the device, no host sync). Returns [B, Hq, D] in q's dtype.
    """
    if _use_triton(q, impl):
        from .triton.launch import ds_decode as _ds
        return _ds(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token, req_idx,
                   seq_lens, sm_scale, heavy_token_num, mode, threshold, num_sink, num_recent, ws, out)
    o = torch_ops.ds_decode(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token,
                            req_idx, seq_lens, sm_scale, heavy_token_num, mode, threshold,
                            num_sink, num_recent).to(q.dtype)
    if out is not None:
        out.copy_(o)
        return out
    return o


# The Triton RoPE kernel passes its tests under the interpreter but has not been compiled on a GPU
# yet (the session's GPU time ran out); "auto" keeps the PyTorch form until it has been checked.
ROPE_TRITON_BY_DEFAULT = False


def rope(positions, q, k, cos, sin, impl: str = "auto"):
    """Rotate-half RoPE. positions: [T] int; q: [T, Hq, D]; k: [T, Hkv, D] (last dim contiguous);
    cos, sin: [max_pos, D/2] float32. Returns new contiguous (q, k) in their dtypes, computed in
    float32 and rounded once."""
    if impl == "auto" and not ROPE_TRITON_BY_DEFAULT:
        impl = "torch"
    if _use_triton(q, impl):
        from .triton.launch import rope as _rope
        return _rope(positions, q, k, cos, sin)
    return torch_ops.rope(positions, q, k, cos, sin)
