"""Exact attention: dense prefill, dense decode over every cached token."""

from __future__ import annotations

from ..kernels import ops
from .base import AttentionBackend


class DenseBackend(AttentionBackend):
    name = "dense"

    def decode_attention(self, layer_id, q, batch, q_label=None):
        """q [B, Hq, D] -> [B, Hq, D]; lengths from ``batch.seq_lens`` (device, int32)."""
        m = self.memory
        return ops.dense_decode(q, m.k[layer_id], m.v[layer_id], m.req_to_token, batch.req_idx,
                                batch.seq_lens, self.sm_scale, ws=self.workspace, impl=self.impl,
                                tuning=self.tuning, **self.kv_scales(layer_id))
