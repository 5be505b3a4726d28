"""DS-Offload: Double Sparsity decode with K and V in a host store and labels on the device.

Per decode step and layer:
  1. labels are scored and each request's top-k is selected on the device, as in-GPU Double
     Sparsity (the same kernels: ds_launch.ds_decode up to its select stage, or the PyTorch twin);
  2. the selected tokens' slots (a request at most its k long: all its positions) are looked up in
     the request's device hot set (attention/offload_hot.py); misses get least recently used rows;
  3. only the misses are copied from the host store (kernels/host_copy.py: a Triton gather
     reading pinned host memory on CUDA, index copies on CPU);
  4. the existing attention kernel runs over the hot rows, with the selection translated to hot
     row indices (same tokens, same order: the output equals in-GPU Double Sparsity's exactly).
New tokens' K/V go to the host store (and their labels to the device pool) when they are stored;
prefill writes each chunk's K/V there, and a chunk with a cached prefix gathers it back.

Rows: with the "layer" selection mode (every head of a layer shares one selection: the default
under DS-Offload) the hot set and every copy move a token's K (and V) of all KV heads of a layer as
one row of Hkv * D values (2 KB for 8 heads of 128 in bf16), the piece page-locked host memory
serves at PCIe speed; with a group mode, one row per (token, KV head) (256 B there), each KV head
selecting its own tokens. Stores and prefix gathers always move whole tokens.

fp8 K/V (``--kv-cache-dtype fp8_*``): the host store, its device tier and the hot set hold fp8
(half the bytes of every row, so half the PCIe bytes per miss), with the memory's per-layer
``k_scale`` / ``v_scale``: stores quantize on the way to the host (the in-GPU store's arithmetic),
fetches and prefix gathers move fp8 bytes, and the attention kernels (or the PyTorch twin) and
the prefill dequantize where they read, as they read the in-GPU fp8 pools.

``fetch``: "reuse" (the hot set), "no-reuse" (every selected row fetched every step) or
"full-kv" (no selection: dense attention reading each request's whole K/V from the host store
each step, as offloaded caches do).
"""

from __future__ import annotations

import dataclasses

import torch

from ..kernels import ops, parts
from ..kernels.host_copy import copy_to_tiers, token_rows
from ..kernels.reference import store_labels_ref
from ..kernels import torch_ops
from .budget import DecodePolicy
from .double_sparsity import DoubleSparsityBackend
from .offload_hot import HotSet
from .offload_prefill import OffloadPrefill

FETCH_MODES = ("reuse", "no-reuse", "full-kv")
PREFETCH_MODES = ("none", "next-layer")


def hot_units(ds, num_layers: int, num_kv_heads: int) -> int:
    """Hot-set units per (request, layer) of DS-Offload under ``ds``'s modes: 1 (a row is a
    token's K/V of every KV head) when every layer selects in the "layer" mode, else one per KV
    head. A mix of the two is refused (one hot set serves every layer)."""
    modes = {ds.mode_of(i) for i in range(num_layers)}
    if "layer" in modes and len(modes) > 1:
        raise ValueError(f"--enable-ds-offload needs one row layout for every layer: the layer selection "
                         f"mode for all layers or for none (got {sorted(modes)}); pass --ds-selection-mode")
    return 1 if modes == {"layer"} else int(num_kv_heads)


class OffloadDSBackend(OffloadPrefill, DoubleSparsityBackend):
    """memory: OffloadKVMemory (engine/offload_memory.py) whose ``k``/``v`` are the host store's
    tensors ([S, Hkv, D] per layer, on the host: pinned on CUDA) and whose labels are on the
    device; hot: a :class:`HotSet` on the device; fetch: one of :data:`FETCH_MODES`. A request
    decodes sparsely iff it is longer than its k (no dense/sparse cost choice: a dense request
    longer than the hot set could not be served from it)."""

    name = "double_sparsity_offload"

    def __init__(self, memory, num_q_heads, head_dim, sm_scale=None, impl="auto", workspace=None,
                 channels=None, ds=None, tuning=None, hot: HotSet | None = None, fetch: str = "reuse",
                 prefetch: str = "none"):
        if fetch not in FETCH_MODES:
            raise ValueError(f"fetch must be one of {FETCH_MODES}, got {fetch!r}")
        if prefetch not in PREFETCH_MODES or (prefetch != "none" and fetch != "reuse"):
            raise ValueError(f"prefetch must be one of {PREFETCH_MODES}, and 'none' unless fetch is "
                             f"'reuse' (got {prefetch!r} with {fetch!r})")
        if ds is not None:
            ds = dataclasses.replace(ds, threshold=0, batch_parts=1,
                                     policy=DecodePolicy(ds.policy.budget, 0, None))
            if ds.top_p:
                raise ValueError("--enable-ds-offload does not support --ds-budget-mode top_p")
            if any(ds.mode_of(i) == "per_head" for i in range(len(memory.k))):
                raise ValueError("--enable-ds-offload needs a group selection mode (group_max or "
                                 "group_sum): per_head selects per query head and the hot set is per KV head "
                                 "(--ds-selection-mode group_max overrides a channel config's per_head layers)")
        kw = {} if tuning is None else {"tuning": tuning}
        super().__init__(memory, num_q_heads, head_dim, sm_scale, impl, workspace, channels, ds, **kw)
        if hot is None or hot.capacity < self.ds.k_max:
            raise ValueError("the hot set must hold at least the largest top-k per request")
        Hkv = memory.plan.num_kv_heads
        self.units = hot_units(self.ds, len(memory.k), Hkv)
        if hot.k[0].shape[1:] != (self.units, Hkv * head_dim // self.units):
            raise ValueError(f"the hot set's rows {tuple(hot.k[0].shape[1:])} do not fit the selection "
                             f"({self.units} per request and layer of {Hkv * head_dim // self.units} values)")
        self.hot = hot
        self.fetch = fetch
        self.prefetch = prefetch
        self._device = memory.label[0].device
        self._inflight: dict = {}   # layer -> tensors a side-stream prefetch into it still reads
        self._prefetch_stream = (torch.cuda.Stream(self._device)
                                 if prefetch != "none" and self._device.type == "cuda" else None)
        self._triton = impl == "triton" or (impl == "auto" and self._device.type == "cuda")

    # ------------------------------------------------------------------- stores and prefill
    def forward(self, layer_id, q, k, v, batch):
        """Stores K/V to the host store and labels to the device pool, then attends (q and k
        rotated first where ``k_rotation`` is set; the labels and the selection keep the
        unrotated k and q)."""
        qr, kr = self.rotate(layer_id, q, k)
        self._join(layer_id)
        self.store(layer_id, kr, v, batch.out_slots, k_label=k)
        return self.attention(layer_id, qr, kr, v, batch, q_label=q)

    def store(self, layer_id, k, v, slots, k_label=None) -> None:
        m = self.memory
        store_labels_ref(m.label[layer_id], m.label_scale[layer_id], k if k_label is None else k_label, slots,
                         self.channels[layer_id])
        # whole tokens: one row of Hkv * D values each
        N = k.shape[0]
        kt, vt = k.reshape(N, 1, -1), v.reshape(N, 1, -1)
        zero = torch.zeros(N, dtype=torch.long, device=k.device)
        copy_to_tiers(kt, vt, torch.arange(N, device=k.device), token_rows(self.tiers(layer_id)),
                      slots.long(), zero, torch.ones(N, dtype=torch.bool, device=k.device),
                      impl="triton" if self._triton else "torch", **self.kv_scales(layer_id))

    def tiers(self, layer_id):
        """Where layer ``layer_id``'s K/V live: the memory's ``tiers`` (engine/offload_memory.py's
        OffloadKVMemory), or its own ``k``/``v`` lists for a memory without them (no device tier)."""
        tiers = getattr(self.memory, "tiers", None)
        if tiers is not None:
            return tiers(layer_id)
        return self.memory.k[layer_id], self.memory.v[layer_id], None, None, 0

    def _hot_tiers(self, layer_id):
        """The store as the hot set's rows see it: whole tokens, or per (token, KV head)."""
        tiers = self.tiers(layer_id)
        return token_rows(tiers) if self.units == 1 else tiers

    # ------------------------------------------------------------------------------ decode
    def decode_attention(self, layer_id, q, batch, q_label=None):
        """The selection (and the next layer's prefetch) scores ``q_label`` (the unrotated q
        under a q/K rotation; default q), the attention reads q."""
        ql = q if q_label is None else q_label
        if layer_id == 0:
            self.hot.tick()
        m = self.memory
        if self.fetch == "full-kv":
            if not self._triton:
                return ops.dense_decode(q, m.k[layer_id], m.v[layer_id], m.req_to_token, batch.req_idx,
                                        batch.seq_lens, self.sm_scale, impl="torch", **self.kv_scales(layer_id))
            # the dense kernel reads every token's K/V straight from pinned host memory (the
            # launcher's device checks would refuse the host pools, so it is called below them)
            B, Hkv = q.shape[0], m.plan.num_kv_heads
            S = parts.dense_splits(B, Hkv, self.workspace, q.device, self.tuning)
            return parts.split_attention(q, m.k[layer_id], m.v[layer_id], m.req_to_token, batch.req_idx, batch.seq_lens,
                                   self.sm_scale, self.workspace, None, None, Hkv, None, 0, False, S, self.tuning,
                                   **self.kv_scales(layer_id))
        args = self.layer_args(layer_id, batch)
        self._join(layer_id)
        if self._triton:
            out = self._decode_triton(layer_id, q, ql, batch, args)
        else:
            out = self._decode_torch(layer_id, q, ql, batch, args)
        if self.prefetch == "next-layer" and layer_id + 1 < len(m.k):
            self._prefetch(layer_id + 1, ql, batch, self.layer_args(layer_id + 1, batch))
        return out

    def _hot_rows(self, layer_id, req_idx, slots, valid):
        """Hot rows of the wanted slots, after fetching the misses. [B, Hkv, K] int32."""
        hot, fetch = self.hot.lookup(layer_id, req_idx, slots, valid, reuse=self.fetch == "reuse")
        self.hot.fetch(layer_id, self._hot_tiers(layer_id), slots, hot, fetch,
                       impl="triton" if self._triton else "torch")
        return hot

    def _prefetch(self, layer_id, q, batch, args) -> None:
        """The paper's prediction: score layer ``layer_id``'s labels with the previous layer's query,
        and fetch the rows of that guessed selection now; on CUDA on a side stream, so that the copy
        overlaps the rest of the previous layer (the layer's own lookup joins it and fixes up its
        misses). The outputs do not depend on it: only what is resident when the layer runs."""
        if self._triton:
            slots, valid, _ = self._select_triton(layer_id, q, batch, args)
        else:
            slots, valid = self._select_torch(layer_id, q, batch, args)[:2]
        # never this step's new token: its K/V reach the host store only when the layer runs
        valid = valid & (slots != batch.out_slots.view(-1, 1, 1))
        hot, fetch = self.hot.lookup(layer_id, batch.req_idx, slots.long(), valid, predicted=True)
        impl = "triton" if self._triton else "torch"
        if not q.is_cuda:
            self.hot.fetch(layer_id, self._hot_tiers(layer_id), slots.long(), hot, fetch, impl=impl)
            return
        main = torch.cuda.current_stream(q.device)
        side = self._prefetch_stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self.hot.fetch(layer_id, self._hot_tiers(layer_id), slots.long(), hot, fetch, impl=impl)
        # kept alive until the join: the side stream reads them
        self._inflight[layer_id] = (slots, hot, fetch)

    def _join(self, layer_id) -> None:
        if self._inflight.pop(layer_id, None) is not None:
            torch.cuda.current_stream(self._device).wait_stream(self._prefetch_stream)

    def _select_triton(self, layer_id, q, batch, args):
        """Layer ``layer_id``'s selection on the device -> (slots [B, U, K] KV slots, valid
        [B, U, K] bool, n [B] tokens per row; U = ``self.units``): the top-k of a sparse request,
        all positions of a request no longer than its k."""
        m, d, ws = self.memory, self.ds, self.workspace
        K, U = d.k_max, self.units
        B = q.shape[0]
        seq = batch.seq_lens
        sparse = batch.ds_sparse
        lab = m.label[layer_id]
        if sparse:
            select = parts.layer_select if U == 1 else parts.group_select
            sel = select(q, lab, m.label_scale[layer_id], self.channels[layer_id], m.req_to_token, batch.req_idx,
                         seq, self.sm_scale, args, ws)
        ks = args.k
        dense = seq <= ks                                                       # [B]
        ar = torch.arange(K, device=q.device)
        n = torch.where(dense, seq, ks.clamp(max=K))                            # [B]
        walked = m.req_to_token[batch.req_idx.long()[:, None], ar[None, :].clamp(max=m.req_to_token.shape[1] - 1)]
        slots = walked[:, None, :].expand(B, U, K)
        if sparse:
            slots = torch.where(dense[:, None, None], slots, sel)
        return slots, ar[None, None, :] < n[:, None, None], n

    def _decode_triton(self, layer_id, q, q_label, batch, args):
        m, ws = self.memory, self.workspace
        K, B, Hkv = self.ds.k_max, q.shape[0], m.plan.num_kv_heads
        slots, valid, n = self._select_triton(layer_id, q_label, batch, args)
        rows = self._hot_rows(layer_id, batch.req_idx, slots.long(), valid)
        # every row reads its n hot rows through the sparse-list path: a length of n + 1 with a
        # budget of n makes the kernel take the list (the tokens and their order are the in-GPU
        # path's, dense rows included, so are the tile boundaries)
        n32 = n.to(torch.int32)
        if batch.ds_sparse:
            S = parts.sparse_splits(B, Hkv, Hkv, K, ws, q.device, self.tuning)
        else:
            S = parts.dense_splits(B, Hkv, ws, q.device, self.tuning)
        D = self.head_dim
        hk, hv = self.hot.k[layer_id].view(-1, Hkv, D), self.hot.v[layer_id].view(-1, Hkv, D)
        return parts.split_attention(q, hk, hv, m.req_to_token, batch.req_idx, n32 + 1, self.sm_scale, ws, None,
                               rows.expand(B, Hkv, K), Hkv, n32, K, False, S, self.tuning,
                               self.tuning.sparse_attn_stages, **self.kv_scales(layer_id))

    def _select_torch(self, layer_id, q, batch, args):
        """The PyTorch twin of the selection: torch_ops.ds_decode's scores and top-k call ->
        (slots [B, U, K], valid [B, U, K], K = the widest row, host lists of lengths and ks)."""
        m, d = self.memory, self.ds
        B, Hkv, dev = q.shape[0], self.units, q.device
        req_idx, seq_lens, kl = batch.req_idx.tolist(), batch.seq_lens.tolist(), args.k.tolist()
        ns = [n if n <= k else k for n, k in zip(seq_lens, kl)]
        K = max(ns)
        slots = torch.zeros(B, Hkv, K, dtype=torch.int64, device=dev)
        valid = torch.zeros(B, Hkv, K, dtype=torch.bool, device=dev)
        for b, (row, n, k) in enumerate(zip(req_idx, seq_lens, kl)):
            start, sl = torch_ops.token_rows(m.req_to_token, row, n)
            if n <= k:
                slots[b, :, :n] = (torch.arange(start, start + n, device=dev) if sl is None else sl)[None]
            else:
                s = torch_ops.label_scores(q[b], m.label[layer_id], m.label_scale[layer_id],
                                           self.channels[layer_id], start, sl, n, self.sm_scale,
                                           d.mode_of(layer_id))
                if d.num_sink:
                    s[:, :d.num_sink] = float("inf")
                if d.num_recent:
                    s[:, n - d.num_recent:] = float("inf")
                top = s.topk(k, dim=-1, sorted=False).indices
                slots[b, :, :k] = top + start if sl is None else sl[top]
            valid[b, :, :ns[b]] = True
        return slots, valid, seq_lens, kl

    def _decode_torch(self, layer_id, q, q_label, batch, args):
        """The PyTorch twin: the same selection, the hot set, then torch_ops.ds_decode's attention
        over the same rows (gathered from the hot set)."""
        B, Hq, D = q.shape
        Hkv = self.memory.plan.num_kv_heads
        G = Hq // Hkv
        slots, valid, seq_lens, kl = self._select_torch(layer_id, q_label, batch, args)
        # [B, Hkv, K]; a token row's head h is row * Hkv + h of the [-1, D] view either way
        rows = self._hot_rows(layer_id, batch.req_idx, slots, valid).long().expand(B, Hkv, -1)
        hk, hv = self.hot.k[layer_id].view(-1, D), self.hot.v[layer_id].view(-1, D)
        sc = torch_ops.kv_scales(hk, **self.kv_scales(layer_id))   # fp8 hot rows: their scales
        out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
        heads = torch.arange(Hkv, device=q.device)
        for b, (n, k) in enumerate(zip(seq_lens, kl)):
            qb = q[b].float().view(Hkv, G, D)
            if n <= k:
                # [n, Hkv, D] then transposed: the strides of the in-GPU path's pool slice
                flat = (rows[b, :, :n].t() * Hkv + heads[None, :]).reshape(-1)
                kk = hk.index_select(0, flat).view(n, Hkv, D).transpose(0, 1)
                vv = hv.index_select(0, flat).view(n, Hkv, D).transpose(0, 1)
            else:
                flat = (rows[b, :, :k] * Hkv + heads[:, None]).reshape(-1)
                kk = hk.index_select(0, flat).view(Hkv, k, D)
                vv = hv.index_select(0, flat).view(Hkv, k, D)
            out[b] = torch_ops.attend(qb, kk, vv, self.sm_scale, scales=sc).view(Hq, D)
        return out.to(q.dtype)

    # ----------------------------------------------------------------------------- facts
    def decode_bytes(self, seq_lens_host) -> int:
        """Device-side bytes: labels of every token plus the selected K/V read from the hot set
        (the host->device bytes are counted by the hot set's counters)."""
        if self.fetch == "full-kv":
            return sum(seq_lens_host) * self.memory.plan.kv_bytes_per_token
        return super().decode_bytes(seq_lens_host)

    def fetch_stats(self) -> dict:
        """Hot-set counters so far, with host->device bytes (one host sync); rows fetched from a
        device tier are device copies, counted in ``device_bytes`` instead."""
        s = self.hot.stats()
        p = self.memory.plan
        row = 2 * p.head_dim * p.kv_dtype.itemsize * (p.num_kv_heads // self.units)
        s["bytes"] = (s["misses"] + s["prefetched"] - s["device_fetched"]) * row
        s["device_bytes"] = s["device_fetched"] * row
        return s
