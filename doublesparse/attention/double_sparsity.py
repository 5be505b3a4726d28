"""Double Sparsity: dense prefill that also writes K labels; sparse decode.

Decode per layer: label scores ``q[heavy] . label`` for every cached token -> top-k on the device
-> exact attention over the selected tokens only. Requests with ``seq_len <= k`` (or below the
threshold) decode densely inside the same launches, decided on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernels import ops
from .base import AttentionBackend


@dataclass(frozen=True)
class DSParams:
    heavy_token_num: int
    mode: str = "group_max"
    threshold: int = 0
    num_sink: int = 0
    num_recent: int = 0


class DoubleSparsityBackend(AttentionBackend):
    name = "double_sparsity"
    stores_labels = True

    def __init__(self, memory, num_q_heads, head_dim, sm_scale=None, impl="auto", workspace=None,
                 channels=None, ds: DSParams | None = None):
        super().__init__(memory, num_q_heads, head_dim, sm_scale, impl, workspace, channels)
        if ds is None:
            raise ValueError("DoubleSparsityBackend needs DSParams")
        self.ds = ds

    def decode_attention(self, layer_id, q, batch):
        m, d = self.memory, self.ds
        return ops.ds_decode(q, m.k[layer_id], m.v[layer_id], m.label[layer_id], m.label_scale[layer_id],
                             self.channels[layer_id], m.req_to_token, batch.req_idx, batch.seq_lens,
                             self.sm_scale, d.heavy_token_num, d.mode, d.threshold, d.num_sink,
                             d.num_recent, ws=self.workspace, impl=self.impl)

    def sparse_rows(self, seq_lens_host) -> list[bool]:
        # same rule as the kernels' device-side choice (reference.is_sparse)
        d = self.ds
        return [n > d.heavy_token_num and n >= d.threshold for n in seq_lens_host]

    def decode_bytes(self, seq_lens_host) -> int:
        """Labels of every cached token + K/V of the selected ones (dense rows: all K/V)."""
        p = self.memory.plan
        rows_sel = self.num_q_heads if self.ds.mode == "per_head" else p.num_kv_heads
        sel_kv = 2 * p.num_layers * rows_sel * p.head_dim * p.kv_dtype.itemsize
        total = 0
        for n, sparse in zip(seq_lens_host, self.sparse_rows(seq_lens_host)):
            if sparse:
                total += n * p.label_bytes_per_token + self.ds.heavy_token_num * sel_kv
            else:
                total += n * p.kv_bytes_per_token
        return total
