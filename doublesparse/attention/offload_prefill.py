"""Prefill of DS-Offload (attention/offload.py): each chunk's K/V go to the host store when stored;
a chunk after a cached prefix gathers the prefix's K/V of one layer back to the device (one
host-gather launch on CUDA), in blocks of ``prefix_block`` tokens for a long prefix, so that a
prompt larger than the device's memory can be prefilled chunk by chunk. An fp8 store's rows are
gathered in fp8 and dequantized on the device, and a chunk attends to its own K/V as the store
holds them (quantized and dequantized): the in-GPU fp8 prefill's values (attention/base.py)."""

from __future__ import annotations

import torch

from ..kernels.host_copy import copy_from_tiers, token_rows
from ..kernels.reference import dequant_kv, is_fp8_kv
from .base import as_cached
from .prefill import sdpa_with_lse, repeat_kv, use_split, prefill_sdpa


def _merge(acc, lse, o, lo):
    """Softmax over the union of two key sets from the two partial results (o [H, n, D] float32,
    natural-log lse [H, n, 1]): -> (merged o, merged lse); acc None: o itself."""
    if acc is None:
        return o, lo
    m = torch.maximum(lse, lo)
    w1, w2 = torch.exp(lse - m), torch.exp(lo - m)
    return (acc * w1 + o * w2) / (w1 + w2), m + torch.log(w1 + w2)


class OffloadPrefill:
    """Prefill attention over K/V in the host store (``self.memory.k/v``); mixed into the
    backend, whose ``_triton``, ``sm_scale``, ``tuning``, ``cudnn_shapes`` and ``_scales`` it reads."""

    # a cached prefix longer than this is attended to in blocks of this many tokens (peak device
    # memory of a chunk's prefill: one block's K/V, not the whole context's)
    prefix_block = 131072

    def prefill_attention(self, layer_id, q, k, v, batch) -> torch.Tensor:
        out = torch.empty_like(q)
        tiers = self.tiers(layer_id)
        kp, vp = tiers[0], tiers[1]
        scales = self._scales(layer_id)
        for s in batch.attn_meta.segments:
            qs = q[s.q_start: s.q_start + s.q_len].transpose(0, 1)
            if s.kv_slots is None:
                ks = as_cached(k[s.q_start: s.q_start + s.q_len], kp.dtype, scales[0], q.dtype).transpose(0, 1)
                vs = as_cached(v[s.q_start: s.q_start + s.q_len], vp.dtype, scales[1], q.dtype).transpose(0, 1)
                o = prefill_sdpa(qs, ks, vs, 0, self.sm_scale, tuning=self.tuning, shapes=self.cudnn_shapes)
            elif s.prefix_len > self.prefix_block and (not q.is_cuda or use_split(qs, True)):
                o = self._blocked_prefix(qs, k[s.q_start: s.q_start + s.q_len], v[s.q_start: s.q_start + s.q_len],
                                         tiers, s.kv_slots[:s.prefix_len], scales)
            else:
                # the cached prefix and this chunk, gathered from the host store (one layer at a time)
                ks, vs = self._gather(tiers, s.kv_slots, q, scales)
                o = prefill_sdpa(qs, ks, vs, s.prefix_len, self.sm_scale, s.mask, self.tuning, self.cudnn_shapes)
            out[s.q_start: s.q_start + s.q_len] = o.transpose(0, 1)
        return out

    def _blocked_prefix(self, qs, k, v, tiers, prefix_slots, scales=(None, None)):
        """A chunk's attention over a long cached prefix, ``prefix_block`` tokens of it on the device
        at a time: each block against the chunk's queries (the query group folded into the rows,
        no mask), then the chunk against itself (causal), merged by their log-sum-exps in float32.
        qs [Hq, n, D]; k, v [n, Hkv, D] the chunk's own rows -> [Hq, n, D] in qs's dtype. The
        merge rounds differently from one call over the whole prefix (the unblocked path).
        scales: the layer's (k_scale, v_scale), read for an fp8 store."""
        Hq, n, D = qs.shape
        kp, vp = tiers[0], tiers[1]
        Hkv = kp.shape[1]
        G = Hq // Hkv
        qs = qs.contiguous()
        acc = lse = None
        for a in range(0, prefix_slots.numel(), self.prefix_block):
            kb, vb = self._gather(tiers, prefix_slots[a:a + self.prefix_block], qs, scales)
            rows = self.cudnn_shapes.rows(qs, G * n, kb.shape[1], False, Hkv, Hkv)
            ob, lb = sdpa_with_lse(qs.view(Hkv, G * n, D), kb, vb, False, self.sm_scale, rows)
            acc, lse = _merge(acc, lse, ob.reshape(Hq, n, D).float(), lb.reshape(Hq, n, 1))
        ks = as_cached(k, kp.dtype, scales[0], qs.dtype).transpose(0, 1)
        vs = as_cached(v, vp.dtype, scales[1], qs.dtype).transpose(0, 1)
        if G > 1:
            ks, vs = repeat_kv(qs, ks, vs)
        o2, l2 = sdpa_with_lse(qs, ks, vs, True, self.sm_scale, self.cudnn_shapes.rows(qs, n, n, True, Hq, Hq))
        acc, _ = _merge(acc, lse, o2.float(), l2)
        return acc.to(qs.dtype)

    def _gather(self, tiers, slots, q, scales=(None, None)):
        """K/V rows of ``slots`` [n] from the store (``tiers``: HostKVStore.tiers of the layer) ->
        ([Hkv, n, D], [Hkv, n, D]) in q's dtype on q's device (CUDA: one gather kernel reading
        pinned memory, no staging copy; a device tier adds one from the device pools). An fp8
        store's rows cross in fp8 and are dequantized with ``scales`` (k_scale, v_scale) here."""
        kp, vp, dk, _, n_dev = tiers
        if not self._triton and dk is None:
            idx = slots.to(kp.device)
            return (_read(kp[idx].to(q.device), scales[0], q.dtype).transpose(0, 1),
                    _read(vp[idx].to(q.device), scales[1], q.dtype).transpose(0, 1))
        n, H, D = slots.numel(), kp.shape[1], kp.shape[2]
        ks = torch.empty(n, H, D, dtype=kp.dtype, device=q.device)
        vs = torch.empty_like(ks)
        # whole tokens: one row of H * D values each
        dev = q.device
        copy_from_tiers(token_rows(tiers), ks.view(n, 1, H * D), vs.view(n, 1, H * D), slots.to(dev).long(),
                        torch.arange(n, device=dev), torch.zeros(n, dtype=torch.long, device=dev),
                        torch.ones(n, dtype=torch.bool, device=dev), impl="triton" if self._triton else "torch")
        return _read(ks, scales[0], q.dtype).transpose(0, 1), _read(vs, scales[1], q.dtype).transpose(0, 1)


def _read(rows, scale, dtype):
    """Gathered rows [n, H, D] as attention reads them, in ``dtype``: an fp8 store's dequantized
    with its ``scale`` ([1] float32), as attention/base.py's ``cached_rows`` reads the in-GPU pool."""
    return dequant_kv(rows, scale).to(dtype) if is_fp8_kv(rows) else rows.to(dtype)
