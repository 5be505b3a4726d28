"""Double Sparsity: dense prefill that also writes K labels; sparse decode.

Decode per layer: label scores ``q[heavy] . label`` for every cached token -> top-k on the device
-> exact attention over the selected tokens only. Requests with ``seq_len <= k`` (or below the
threshold) get the budget DENSE (``row_budgets``) and decode densely inside the same launches,
decided on the device.

Batch parts (CUDA): a decode batch can be cut into parts of whole requests, each launched on its
own stream over its own workspace rows and joined before the output is used, so that the select's
latency-bound passes of one part overlap the byte-bound scoring and attention of another. Inside a
CUDA graph the streams become parallel branches. ``DSParams.batch_parts``: that many parts, or 0
for the default: 2 parts from ``AUTO_PARTS_MIN_BATCH`` requests, else 1. Measured on an H200
(benchmarks/ds_streams.py, one Llama-3.1-8B layer, r 16, k = L/16): 2 parts on
2 streams took bs 16 x 32K from 143-147 to 132-134 us (the engine's decode step 9.15 -> 8.77 ms),
left bs 3 x 128K unchanged (114-116 us) and made smaller batches slower (bs 3 x 64K 66 -> 72,
bs 8 x 16K 49 -> 54); 3 or 4 parts were slower than 2.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..kernels import ops
from ..kernels.tuning import DEFAULT_TUNING, KernelTuning
from .base import AttentionBackend
from .budget import DENSE

AUTO_PARTS_MIN_BATCH = 16


@dataclass(frozen=True)
class DSParams:
    heavy_token_num: int
    mode: str = "group_max"
    threshold: int = 0
    num_sink: int = 0
    num_recent: int = 0
    batch_parts: int = 0  # 0 = auto (see the module docstring)


def row_budgets(ds: DSParams, seq_lens: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """Each request's budget for ops.ds_decode ([B] int32 on seq_lens' device): the one k where
    it decodes sparsely (seq_len > k and seq_len >= threshold, i.e. seq_len > max(k,
    threshold - 1)), else DENSE. dense: a 0-dim int32 DENSE on that device, so that the result
    is int32 in two device ops (a compare and a select), capturable in a CUDA graph."""
    k = ds.heavy_token_num
    return torch.where(seq_lens > max(k, ds.threshold - 1), k, dense)


def cut_batch(batch_size: int, parts: int) -> list[tuple[int, int]]:
    """Row ranges ``[(a, b), ...]`` of at most ``parts`` near-equal, non-empty parts of a batch."""
    parts = max(1, min(parts, batch_size))
    edges = [round(i * batch_size / parts) for i in range(parts + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


class DoubleSparsityBackend(AttentionBackend):
    name = "double_sparsity"
    stores_labels = True

    def __init__(self, memory, num_q_heads, head_dim, sm_scale=None, impl="auto", workspace=None,
                 channels=None, ds: DSParams | None = None, tuning: KernelTuning = DEFAULT_TUNING):
        super().__init__(memory, num_q_heads, head_dim, sm_scale, impl, workspace, channels, tuning)
        if ds is None:
            raise ValueError("DoubleSparsityBackend needs DSParams")
        self.ds = ds
        # DENSE as a 0-dim device tensor, made here (not during a graph capture, where it would be
        # filled only on replay) for row_budgets.
        self._dense = torch.full((), DENSE, dtype=torch.int32, device=memory.k[0].device)
        self._streams: list = []   # side streams for batch parts 1.. (created on first use)
        self._parts: dict = {}     # batch size -> [(a, b, workspace views over rows a:b)]

    def decode_attention(self, layer_id, q, batch):
        parts = self._batch_parts(q.shape[0])
        if len(parts) == 1:
            return self._decode(layer_id, q, batch.req_idx, batch.seq_lens, self.workspace)
        out = torch.empty_like(q)
        main = torch.cuda.current_stream(q.device) if q.is_cuda else None
        side = self._side_streams(len(parts) - 1, q.device) if main is not None else []
        for s in side:
            s.wait_stream(main)
        for j, (a, b, ws) in enumerate(parts):
            with torch.cuda.stream(side[j - 1]) if j and side else contextlib.nullcontext():
                self._decode(layer_id, q[a:b], batch.req_idx[a:b], batch.seq_lens[a:b], ws, out[a:b])
        for s in side:
            main.wait_stream(s)
        return out

    def _batch_parts(self, B):
        """[(a, b, workspace rows a:b)] of a decode batch of B; one entry: run it whole."""
        if B not in self._parts:
            auto = 2 if B >= AUTO_PARTS_MIN_BATCH else 1
            n = self.ds.batch_parts or auto
            if self.workspace is None or n == 1:
                self._parts[B] = [(0, B, self.workspace)]
            else:
                self._parts[B] = [(a, b, self.workspace.rows(a, b)) for a, b in cut_batch(B, n)]
        return self._parts[B]

    def _decode(self, layer_id, q, req_idx, seq_lens, ws, out=None):
        m, d = self.memory, self.ds
        return ops.ds_decode(q, m.k[layer_id], m.v[layer_id], m.label[layer_id], m.label_scale[layer_id],
                             self.channels[layer_id], m.req_to_token, req_idx, seq_lens,
                             self.sm_scale, row_budgets(d, seq_lens, self._dense), d.heavy_token_num, d.mode,
                             d.num_sink, d.num_recent, ws=ws, out=out, impl=self.impl, tuning=self.tuning)

    def _side_streams(self, n, device):
        while len(self._streams) < n:
            self._streams.append(torch.cuda.Stream(device))
        return self._streams[:n]

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
