"""The attention-backend interface and the parts shared by every backend.

A backend owns the KV (and label) pools of one engine. Per step it is used in two phases:

    plan(batch)                       host work (masks, per-request slot lists), outside CUDA graphs;
                                      the result is stored on ``batch.attn_meta``, never on the backend
    forward(layer_id, q, k, v, batch) device launches only; for decode it is graph-capturable
                                      (reads lengths from device tensors, no host syncs)

``forward`` is exactly ``store`` then ``attention``. A model may instead write the new K/V (and
labels) itself, e.g. fused with RoPE, into ``store_targets(layer_id)`` and call
``attention(layer_id, q, k, v, batch)``, when ``accepts_stored_kv`` says the backend allows it.

Both phases receive the per-step state explicitly through the ForwardBatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.bias import CausalBias, causal_lower_right

from ..kernels import ops
from ..kernels.reference import dequant_kv, is_fp8_kv, quantize_kv
from ..kernels.tuning import DEFAULT_TUNING, KernelTuning
from .k_rotation import rotate
from .prefill import CudnnShapes, prefill_sdpa


@dataclass(frozen=True)
class PrefillSegment:
    """One request of a prefill batch: queries ``q[q_start : q_start + q_len]`` at positions
    ``prefix_len ..``; ``kv_slots`` [prefix_len + q_len] int64 (device) when there is a cached
    prefix to gather, else None (attend to the fresh k/v); ``mask``: lower-right causal
    CausalBias (q_len x prefix_len + q_len) when there is a prefix."""

    q_start: int
    q_len: int
    prefix_len: int
    kv_slots: torch.Tensor | None
    mask: CausalBias | None


@dataclass(frozen=True)
class PrefillMeta:
    segments: tuple[PrefillSegment, ...]


def as_cached(x, cache_dtype, scale, dtype):
    """x [N, H, D] as a pool of ``cache_dtype`` holds it, read back in ``dtype``: a plain round
    trip, or for an fp8 pool quantized with ``scale`` ([1] float32) and dequantized."""
    if not is_fp8_kv(cache_dtype):
        return x.to(cache_dtype).to(dtype)
    return dequant_kv(quantize_kv(x, cache_dtype, scale), scale).to(dtype)


def cached_rows(pool, slots, scale, dtype):
    """Rows ``pool[slots]`` [L, H, D] in ``dtype``, an fp8 pool's dequantized (times ``scale``)."""
    rows = pool[slots]
    return dequant_kv(rows, scale).to(dtype) if is_fp8_kv(rows) else rows.to(dtype)


class AttentionBackend:
    """Dense prefill (SDPA over the cached prefix + new tokens) and the decode hook.

    memory: :class:`~doublesparse.engine.memory.KVMemory`; sm_scale: softmax scale;
    impl: ``ops`` implementation ("auto" | "torch"); workspace: DecodeWorkspace or None (CPU);
    channels: ``[num_layers, Hkv, r]`` int32 device tensor, or None (no label cache);
    tuning: the kernels' launch parameters and choices, passed to every launch.
    k_rotation: None, or R ``[num_layers, Hkv or 1, D, D]`` in the model's dtype on the device
    (attention/k_rotation.py, set by the engine's setup): ``forward`` rotates q and k by layer
    l's R before the K/V pools store them and attention reads them, while the labels are taken
    from the unrotated k and the label scores read the unrotated q (``k_label`` / ``q_label``).
    """

    name = "base"
    stores_labels = False

    def __init__(self, memory, num_q_heads: int, head_dim: int, sm_scale: float | None = None,
                 impl: str = "auto", workspace=None, channels: torch.Tensor | None = None,
                 tuning: KernelTuning = DEFAULT_TUNING):
        self.memory = memory
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.sm_scale = float(sm_scale if sm_scale is not None else head_dim ** -0.5)
        self.impl = impl
        self.workspace = workspace
        self.channels = channels
        self.tuning = tuning
        self.cudnn_shapes = CudnnShapes(tuning.cudnn_graphs)   # what prefill lets cuDNN build
        self.k_rotation: torch.Tensor | None = None
        if self.stores_labels and (channels is None or memory.label[0] is None):
            raise ValueError(f"{self.name} backend needs a label pool and heavy channels")

    # ------------------------------------------------------------------------------- plan
    def plan(self, batch) -> None:
        if batch.mode == "prefill":
            batch.attn_meta = self._plan_prefill(batch)
        else:
            batch.attn_meta = None

    def _plan_prefill(self, batch) -> PrefillMeta:
        segs = []
        start = 0
        for row, prefix, n in zip(batch.rows_host, batch.extend_prefix_lens, batch.extend_lens):
            slots = mask = None
            if prefix:
                total = prefix + n
                slots = self.memory.req_to_token[row, :total].long()
                # lower-right causal: query i sits at position prefix + i. CausalBias lets SDPA
                # pick flash attention (with GQA) on CUDA instead of materialising a mask.
                mask = causal_lower_right(n, total)
            segs.append(PrefillSegment(start, n, prefix, slots, mask))
            start += n
        return PrefillMeta(tuple(segs))

    # ---------------------------------------------------------------------------- forward
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] post-RoPE -> [T, Hq, D] in q's dtype."""
        qr, kr = self.rotate(layer_id, q, k)
        self.store(layer_id, kr, v, batch.out_slots, k_label=k)
        return self.attention(layer_id, qr, kr, v, batch, q_label=q)

    def attention(self, layer_id: int, q: torch.Tensor, k, v, batch, q_label=None) -> torch.Tensor:
        """Attention with this step's K/V already in the pools (``store`` or a fused store into
        ``store_targets``). q [T, Hq, D] post-RoPE; k, v [T, Hkv, D] this step's rows (post-RoPE
        k; last dim contiguous), read by prefill only: decode may pass None; q_label: the
        unrotated q where q is rotated (what a label score reads; default q). -> [T, Hq, D]."""
        if batch.mode == "prefill":
            return self.prefill_attention(layer_id, q, k, v, batch)
        return self.decode_attention(layer_id, q, batch, q_label=q_label)

    @property
    def accepts_stored_kv(self) -> bool:
        """True when ``forward`` is exactly ``store`` + ``attention`` (not overridden, no rotation
        of q and K), so a caller may do the store itself and call ``attention``."""
        return type(self).forward is AttentionBackend.forward and self.k_rotation is None

    def rotate(self, layer_id: int, q: torch.Tensor, k: torch.Tensor | None):
        """(q, k) rotated by layer ``layer_id``'s R (``k_rotation``), or unchanged without it."""
        if self.k_rotation is None:
            return q, k
        return rotate(q, k, self.k_rotation[layer_id])

    def store_targets(self, layer_id: int):
        """Where ``store`` writes layer ``layer_id``: ``(k_cache, v_cache, label_cache, label_scale,
        channels, k_scale, v_scale)`` ([S, Hkv, D] x2, [S, Hkv, r], [1] f32, [Hkv, r] int32, [1] f32
        x2; label_cache, label_scale and channels None without labels; the K/V scales are read only
        for an fp8 pool), in the argument order of ``ops.store_kv``."""
        m = self.memory
        ks, vs = self._scales(layer_id)
        if self.stores_labels:
            return (m.k[layer_id], m.v[layer_id], m.label[layer_id], m.label_scale[layer_id], self.channels[layer_id],
                    ks, vs)
        return m.k[layer_id], m.v[layer_id], None, None, None, ks, vs

    def store(self, layer_id: int, k, v, slots, k_label=None) -> None:
        """k, v [N, Hkv, D] post-RoPE; slots [N] int -> pools (and K labels, from ``k_label``, the
        unrotated k where k is rotated; default k), one launch on CUDA."""
        kc, vc, lab, scale, ch, ks, vs = self.store_targets(layer_id)
        ops.store_kv(kc, vc, k, v, slots, lab, scale, ch, ks, vs, impl=self.impl,
                     k_label=k_label if lab is not None else None)

    def _scales(self, layer_id: int):
        """(k_scale, v_scale) of layer ``layer_id`` ([1] float32 each), or (None, None) for a
        memory without them (only fp8 pools need them; the kernels refuse fp8 without)."""
        m = self.memory
        if getattr(m, "k_scale", None) is None:
            return None, None
        return m.k_scale[layer_id], m.v_scale[layer_id]

    def kv_scales(self, layer_id: int) -> dict:
        """``k_scale`` / ``v_scale`` keyword arguments of the ops for layer ``layer_id``."""
        ks, vs = self._scales(layer_id)
        return dict(k_scale=ks, v_scale=vs)

    def prefill_attention(self, layer_id, q, k, v, batch) -> torch.Tensor:
        out = torch.empty_like(q)
        m = self.memory
        kp, vp = m.k[layer_id], m.v[layer_id]
        ksc, vsc = self._scales(layer_id)
        for s in batch.attn_meta.segments:
            qs = q[s.q_start: s.q_start + s.q_len].transpose(0, 1)            # [Hq, n, D]
            if s.kv_slots is None:
                # the values the cache holds (what decode will read), in q's dtype
                ks = as_cached(k[s.q_start: s.q_start + s.q_len], kp.dtype, ksc, q.dtype).transpose(0, 1)
                vs = as_cached(v[s.q_start: s.q_start + s.q_len], vp.dtype, vsc, q.dtype).transpose(0, 1)
                o = prefill_sdpa(qs, ks, vs, 0, self.sm_scale, tuning=self.tuning, shapes=self.cudnn_shapes)
            else:
                ks = cached_rows(kp, s.kv_slots, ksc, q.dtype).transpose(0, 1)  # [Hkv, L, D]
                vs = cached_rows(vp, s.kv_slots, vsc, q.dtype).transpose(0, 1)
                o = prefill_sdpa(qs, ks, vs, s.prefix_len, self.sm_scale, s.mask, self.tuning, self.cudnn_shapes)
            out[s.q_start: s.q_start + s.q_len] = o.transpose(0, 1)
        return out

    def decode_attention(self, layer_id, q, batch, q_label=None) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hq, D]; q_label: the unrotated q a label score reads (default q)."""
        raise NotImplementedError

    # ---------------------------------------------------------------------------- facts
    def decode_plan(self, seq_lens_host) -> tuple[list[int] | None, bool]:
        """Per request of a decode step: its top-k (None: this backend selects nothing), and
        whether the step decodes sparsely."""
        return None, False

    def sparse_rows(self, seq_lens_host) -> list[bool]:
        """Per request of a decode step (host-known lengths after the step): does it select tokens?"""
        return [False] * len(seq_lens_host)

    def decode_bytes(self, seq_lens_host) -> int:
        """KV-side bytes one decode step reads across all layers (model-level estimate)."""
        m = self.memory.plan
        return sum(seq_lens_host) * m.kv_bytes_per_token
