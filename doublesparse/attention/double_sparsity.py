"""Double Sparsity: dense prefill that also writes K labels; sparse decode.

Decode per layer: label scores ``q[heavy] . label`` for every cached token -> top-k on the device
-> exact attention over the selected tokens only. Each request has its own k (``DSParams.policy``,
attention/budget.py), planned on the host from lengths it knows and handed to the kernels as a
device tensor (``ForwardBatch.k``); a request whose k is DENSE decodes densely inside the same
launches. ``plan`` turns it, once per step, into each layer's :class:`~..kernels.ops.DSDecodeArgs`
(k, its bound ``DSParams.k_max``, the layer's mode, sink/recent, the top-p budget, the tuning),
which is all the kernels are handed beside the tensors they read. A step in which no request
decodes sparsely (``ForwardBatch.ds_sparse`` False) runs the dense decode kernel alone: the score
and select launches would only add their fixed time. Without a host plan (a ForwardBatch built
without ``k``, as in the kernel tests) the k come from ``DSParams`` on the device (``device_k``).

Batch parts (CUDA): a decode batch can be cut into parts of whole requests, each launched on its
own stream over its own workspace rows and joined before the output is used, so that the select's
latency-bound passes of one part overlap the byte-bound scoring and attention of another. Inside a
CUDA graph the streams become parallel branches. ``DSParams.batch_parts``: that many parts, or 0
for the default: 2 parts from ``AUTO_PARTS_MIN_BATCH`` requests, else 1. Measured on an H200
(``git show 2fcf640^:benchmarks/ds_streams.py``, one Llama-3.1-8B layer, r 16, k = L/16): 2 parts on
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
from .budget import DENSE, DecodePolicy, TokenBudget

AUTO_PARTS_MIN_BATCH = 16


@dataclass(frozen=True)
class DSParams:
    """k_max: the largest k of any request (the workspace's size; ``--ds-heavy-token-num`` where
    the budget is fixed). policy: each request's k and the dense/sparse choice; None: the fixed
    k = k_max for requests of at least ``threshold`` tokens (None there too: every request longer
    than k). layer_modes: each layer's selection mode (calibrated per layer), or empty: ``mode``
    for every layer."""

    k_max: int
    mode: str = "group_max"
    threshold: int | None = 0
    num_sink: int = 0
    num_recent: int = 0
    batch_parts: int = 0  # 0 = auto (see the module docstring)
    policy: DecodePolicy | None = None
    layer_modes: tuple[str, ...] = ()

    def mode_of(self, layer_id: int) -> str:
        return self.layer_modes[layer_id] if self.layer_modes else self.mode

    def __post_init__(self):
        if self.policy is None:
            pol = DecodePolicy(TokenBudget.fixed(self.k_max), self.threshold or 0)
            object.__setattr__(self, "policy", pol)
        if self.policy.budget.k_max > self.k_max:
            raise ValueError(f"the policy's largest k {self.policy.budget.k_max} exceeds k_max {self.k_max}")

    @property
    def top_p(self) -> float:
        """The top-p budget's mass (0: off); each row then keeps at least ``top_p_min_k`` tokens."""
        return self.policy.budget.top_p

    @property
    def top_p_min_k(self) -> int:
        return self.policy.budget.k_min


def device_k(ds: DSParams, seq_lens: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """Each request's k for ops.ds_decode ([B] int32 on seq_lens' device): the one k = k_max where
    it decodes sparsely (seq_len > k and seq_len >= threshold, i.e. seq_len > max(k, threshold -
    1)), else DENSE. dense: a 0-dim int32 DENSE on that device, so that the result is int32 in two
    device ops (a compare and a select), capturable in a CUDA graph."""
    k = ds.k_max
    return torch.where(seq_lens > max(k, (ds.threshold or 0) - 1), k, dense)


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
        # filled only on replay) for device_k.
        # (on the labels' device: an offloading backend's K pool is in host memory)
        self._dense = torch.full((), DENSE, dtype=torch.int32, device=memory.label[0].device)
        self._streams: list = []   # side streams for batch parts 1.. (created on first use)
        self._parts: dict = {}     # batch size -> [(a, b, workspace views over rows a:b)]

    def decode_plan(self, seq_lens_host) -> tuple[list[int], bool]:
        """Per request of a decode step (lengths after it): its k (DENSE: attends to every token),
        and whether the step runs the sparse launches at all."""
        return self.ds.policy.plan(list(seq_lens_host))

    def plan(self, batch) -> None:
        """A sparse decode step's ``attn_meta``: each layer's DSDecodeArgs (``decode_args``)."""
        if batch.mode == "decode" and batch.ds_sparse:
            batch.attn_meta = self.decode_args(batch)
        else:
            super().plan(batch)

    def decode_args(self, batch) -> tuple[ops.DSDecodeArgs, ...]:
        """One DSDecodeArgs per layer (shared by the layers of one mode) with the step's k: the
        batch's ``k`` (in a CUDA graph, its static buffer), or ``device_k`` where the batch has
        none (two device ops). No host sync."""
        d = self.ds
        k = batch.k if batch.k is not None else device_k(d, batch.seq_lens, self._dense)
        modes = [d.mode_of(i) for i in range(len(self.memory.k))]
        args = {m: ops.DSDecodeArgs(k, d.k_max, m, d.num_sink, d.num_recent, d.top_p, d.top_p_min_k, self.tuning)
                for m in dict.fromkeys(modes)}
        return tuple(args[m] for m in modes)

    def layer_args(self, layer_id: int, batch) -> ops.DSDecodeArgs:
        """Layer ``layer_id``'s DSDecodeArgs of this step: the plan's (a sparse step's), else made
        now (a batch that was not planned; DS-Offload's selection on a dense step)."""
        meta = batch.attn_meta if batch.attn_meta is not None else self.decode_args(batch)
        return meta[layer_id]

    def decode_attention(self, layer_id, q, batch, q_label=None):
        """The selection scores ``q_label`` (the unrotated q under a q/K rotation; default q)
        against the labels, the attention reads q."""
        ql = None if q_label is q else q_label   # unrotated: the same tensor
        if not batch.ds_sparse:
            m = self.memory
            return ops.dense_decode(q, m.k[layer_id], m.v[layer_id], m.req_to_token, batch.req_idx,
                                    batch.seq_lens, self.sm_scale, ws=self.workspace, impl=self.impl,
                                    tuning=self.tuning, **self.kv_scales(layer_id))
        parts = self._batch_parts(q.shape[0])
        args = self.layer_args(layer_id, batch)
        if len(parts) == 1:
            return self._decode(layer_id, q, ql, batch.req_idx, batch.seq_lens, self.workspace, args)
        out = torch.empty_like(q)
        main = torch.cuda.current_stream(q.device) if q.is_cuda else None
        side = self._side_streams(len(parts) - 1, q.device) if main is not None else []
        for s in side:
            s.wait_stream(main)
        for j, (a, b, ws) in enumerate(parts):
            with torch.cuda.stream(side[j - 1]) if j and side else contextlib.nullcontext():
                self._decode(layer_id, q[a:b], None if ql is None else ql[a:b], batch.req_idx[a:b],
                             batch.seq_lens[a:b], ws, args.rows(a, b), out[a:b])
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

    def _decode(self, layer_id, q, q_label, req_idx, seq_lens, ws, args, out=None):
        m = self.memory
        return ops.ds_decode(q, m.k[layer_id], m.v[layer_id], m.label[layer_id], m.label_scale[layer_id],
                             self.channels[layer_id], m.req_to_token, req_idx, seq_lens, self.sm_scale, args,
                             ws=ws, out=out, impl=self.impl, **self.kv_scales(layer_id), q_label=q_label)

    def _side_streams(self, n, device):
        while len(self._streams) < n:
            self._streams.append(torch.cuda.Stream(device))
        return self._streams[:n]

    def sparse_rows(self, seq_lens_host) -> list[bool]:
        ks, _ = self.decode_plan(seq_lens_host)
        return [k != DENSE for k in ks]

    def decode_bytes(self, seq_lens_host) -> int:
        """Labels of every cached token + K/V of the selected ones (dense rows: all K/V). With the
        top-p budget the selected count is its upper bound: the device's counts are not read."""
        p = self.memory.plan
        rows_sel = sum(self.num_q_heads if self.ds.mode_of(i) == "per_head" else p.num_kv_heads
                       for i in range(p.num_layers))
        sel_kv = (1 if p.latent else 2) * rows_sel * p.head_dim * p.kv_dtype.itemsize
        total = 0
        for n, k in zip(seq_lens_host, self.decode_plan(seq_lens_host)[0]):
            if k != DENSE:
                total += n * p.label_bytes_per_token + k * sel_kv
            else:
                total += n * p.kv_bytes_per_token
        return total
