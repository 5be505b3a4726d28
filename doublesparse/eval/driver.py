"""A teacher-forcing decode driver on the real kernels: dense prefill, then every scored token
decoded through ``ops.store_kv`` + ``ops.ds_decode`` (or ``ops.dense_decode``) on real KV/label pools.

Batching without changing the maths: the M tokens that follow a prefix are decoded in ONE forward
as M requests sharing one ``req_to_token`` row, request j having ``seq_len = P + j + 1``. Each layer
first stores all M new K/V (and labels), then decodes; since token j only reads slots < P + j + 1,
and those hold exactly what sequential decoding would have written there (layer l of token i
depends only on tokens <= i), the result equals decoding the M tokens one at a time, while the
kernels see a batch of M (the GPU grid relies on this). Several windows are batched the same way,
one ``req_to_token`` row each.

Prefill is dense and shared by every setting of one K/V cache dtype: the K/V of a prefix is
computed once per cache dtype (:class:`PoolSet`: a prefill with an fp8 cache attends to its chunk's
K/V as the cache holds them, as the engine's does, so its later layers' K/V differ) and each setting
only rewrites the labels of the prefix (``ops.store_kv`` over the stored K; skipped when they
already hold its channels) before its decode tokens overwrite the slots after the prefix. No K/V
state needs restoring between settings: a decode forward writes every slot it reads past the prefix
before reading it.
"""

from __future__ import annotations

import math

import torch

from doublesparse.attention import k_rotation
from doublesparse.kernels import ops
from doublesparse.kernels.reference import dequant_kv
from doublesparse.kernels.top_p import keep_mask

from .pools import Pools
from .settings import Setting

__all__ = ["Pools", "PoolSet", "prefill", "decode_tokens", "greedy", "selection_recall"]


def _causal():
    from doublesparse.models.simple_attention import plain_backend
    return plain_backend()


class PrefillAttention:
    """Dense causal prefill of one request; stores its K/V (labels come later, per setting)."""

    def __init__(self, pools: Pools, row: int, positions: torch.Tensor):
        self.pools, self.row, self.positions, self.inner = pools, row, positions, _causal()

    def forward(self, layer_id, q, k, v, batch):
        p = self.pools
        slots = p.slots(torch.full_like(self.positions, self.row), self.positions)
        if p.k_src is not None:
            p.k_src[layer_id][slots.long()] = k
        q, k = p.rotate(layer_id, q, k)
        ops.store_kv(p.k[layer_id], p.v[layer_id], k, v, slots, **p.scales, impl=p.impl)
        return self.inner.forward(layer_id, q, *p.as_read(k, v), batch)


class DecodeAttention:
    """Decode backend: each of the T tokens is one request (row ``rows[t]``, position
    ``positions[t]``, seq_len ``positions[t] + 1``); stores K/V/labels, then decodes.

    ``observer`` (optional) gets ``(layer_id, q, out, self)`` after every double-sparse layer.
    ``q_label``: the unrotated q of the layer the observer is called for (``q`` where nothing
    is rotated), what its label scores read. ``k_sum`` / ``k_rows`` (device tensors): the tokens
    the selection rows of requests that decoded sparsely attended to, summed over rows and
    layers, and the number of such rows.
    """

    def __init__(self, pools: Pools, setting: Setting, channels: torch.Tensor | None, rows, positions,
                 k: int, observer=None):
        self.p, self.s, self.rows, self.positions = pools, setting, rows, positions
        self.k_max = k
        self.channels = None if channels is None else channels.to(pools.device, torch.int32)
        self.req_idx = rows.int()
        self.seq_lens = (positions + 1).int()
        # One k for every request (those no longer than it decode densely).
        self.k = torch.full_like(self.seq_lens, k)
        self.sm_scale = 1.0 / math.sqrt(pools.D)
        self.observer = observer
        self.q_label = None
        # capped at k/8 and k/4 like the engine's default (also keeps sink + recent <= k)
        self.num_sink, self.num_recent = setting.sink_recent(k)
        self.ws = pools.workspace(int(rows.numel()), k if setting.kind == "ds" else 0)
        self.top_p_min = setting.top_p_floor(k)
        self._args: dict = {}   # selection mode -> the ops.DSDecodeArgs of its layers
        # per selection-row count (a per_head layer has Hq rows, the others Hkv)
        self.counts = {R: torch.zeros(int(rows.numel()), R, dtype=torch.int32, device=pools.device)
                       for R in (pools.hq, pools.hkv)}
        self.k_sum = torch.zeros((), dtype=torch.float64, device=pools.device)
        self.k_rows = torch.zeros((), dtype=torch.float64, device=pools.device)

    def forward(self, layer_id, q, k, v, batch):
        p, s = self.p, self.s
        q0, k0 = q, k   # the labels and the label scores read the unrotated q and K
        q, k = p.rotate(layer_id, q, k)
        slots = p.slots(self.rows, self.positions)
        if self.channels is not None:
            lab = p.label_pool(self.channels.shape[-1], s.label)[layer_id]
            ops.store_kv(p.k[layer_id], p.v[layer_id], k, v, slots, lab, p.label_scale, self.channels[layer_id],
                         **p.scales, impl=p.impl, k_label=k0)
        else:
            ops.store_kv(p.k[layer_id], p.v[layer_id], k, v, slots, **p.scales, impl=p.impl)
        if s.is_dense_layer(layer_id):
            return ops.dense_decode(q, p.k[layer_id], p.v[layer_id], p.req_to_token, self.req_idx,
                                    self.seq_lens, self.sm_scale, ws=self.ws, impl=p.impl, **p.scales)
        mode = s.mode_of(layer_id)
        counts = self.counts[p.hq if mode == "per_head" else p.hkv]
        if mode not in self._args:
            self._args[mode] = ops.DSDecodeArgs(self.k, self.k_max, mode, self.num_sink, self.num_recent, s.top_p,
                                                self.top_p_min)
        out = ops.ds_decode(q, p.k[layer_id], p.v[layer_id], lab, p.label_scale, self.channels[layer_id],
                            p.req_to_token, self.req_idx, self.seq_lens, self.sm_scale, self._args[mode], ws=self.ws,
                            impl=p.impl, row_counts=counts, **p.scales, q_label=q0)
        sparse = (self.seq_lens > self.k)[:, None]
        self.k_sum += (counts * sparse).sum()
        self.k_rows += sparse.sum() * counts.shape[1]
        if self.observer is not None:
            self.q_label = q0
            self.observer(layer_id, q, out, self)
        return out


def _batch(attn, logits_indices=None, mode: str = "prefill"):
    from doublesparse.attention.batch import ForwardBatch
    return ForwardBatch(mode=mode, logits_indices=logits_indices, attn=attn)


@torch.inference_mode()
def prefill(model, pools: Pools, prefixes: list[list[int]]) -> torch.Tensor:
    """Dense prefill of request i with ``prefixes[i]``; returns each one's last logits ``[n, V]``."""
    dev = pools.device
    last = []
    pools._labelled.clear()  # new prefix K: every label pool is stale
    for i, ids in enumerate(prefixes):
        pos = torch.arange(len(ids), device=dev)
        b = _batch(PrefillAttention(pools, i + 1, pos), torch.tensor([len(ids) - 1], device=dev))
        last.append(model(torch.tensor(ids, device=dev), pos, b)[0])
        pools.prefix_len[i] = len(ids)
    return torch.stack(last)


class PoolSet:
    """The pools of one set of requests (``prefixes``: each one's prompt ids before its scored or
    generated tokens) for each K/V cache dtype a setting asks for, each prefilled (densely, through
    its own cache) the first time it is asked for. ``Pools`` arguments as there; k_rotation: the
    engine's ``--kv-cache-k-rotation`` ("auto": rotate q and K with an fp8 cache; the labels and
    label scores stay unrotated, so dense and Double Sparsity settings share one rotated cache)."""

    def __init__(self, model, prefixes: list[list[int]], max_ctx: int, device="cpu", impl: str = "auto",
                 k_rotation: str = "auto"):
        self.model, self.prefixes, self.max_ctx, self.device, self.impl = model, prefixes, max_ctx, device, impl
        self.k_rotation = k_rotation
        self._by_kv: dict[tuple, Pools] = {}

    def get(self, kv: str = "auto") -> Pools:
        """The pools of cache dtype ``kv`` (one for dense and Double Sparsity settings alike)."""
        m = self.model
        c = m.config
        rotated = k_rotation.resolve(self.k_rotation, kv.startswith("fp8"), False)
        key = (kv, rotated)
        if key not in self._by_kv:
            rot = (k_rotation.rotation_matrices(int(c.num_layers), int(c.num_kv_heads), int(c.head_dim))
                   if rotated else None)
            pools = Pools(c, len(self.prefixes), self.max_ctx, device=self.device,
                          dtype=getattr(m, "dtype", torch.float32), impl=self.impl, kv_cache_dtype=kv,
                          k_rotation=rot)
            prefill(m, pools, self.prefixes)
            self._by_kv[key] = pools
        return self._by_kv[key]


@torch.inference_mode()
def decode_tokens(model, pools: Pools, setting: Setting, channels, tokens: list[list[int]],
                  k: int, observer=None, k_stats: list | None = None) -> torch.Tensor:
    """Decode ``tokens[i]`` after request i's prefix, all in one forward (see module doc).

    Returns logits ``[sum_i len(tokens[i]), V]`` float32 in request-major order. k_stats: a list
    that gets the forward's ``(k_sum, k_rows)`` (see :class:`DecodeAttention`)."""
    dev = pools.device
    ids, rows, pos = [], [], []
    for i, toks in enumerate(tokens):
        n = pools.prefix_len[i]
        ids += toks
        rows += [i + 1] * len(toks)
        pos += list(range(n, n + len(toks)))
    rows_t = torch.tensor(rows, device=dev)
    pos_t = torch.tensor(pos, device=dev)
    attn = DecodeAttention(pools, setting, channels, rows_t, pos_t, k, observer)
    logits = model(torch.tensor(ids, device=dev), pos_t, _batch(attn, mode="decode")).float()
    if k_stats is not None:
        k_stats.append((attn.k_sum, attn.k_rows))
    return logits


@torch.inference_mode()
def greedy(model, pools: Pools, setting: Setting, channels, first: list[int], steps: int,
           k: int) -> list[list[int]]:
    """Greedy generation: request i decodes ``first[i]`` (its prompt's last token) then ``steps - 1``
    of its own predictions, all through the decode path. Returns the ``steps`` new tokens each."""
    base = list(pools.prefix_len)
    cur = [[t] for t in first]
    out: list[list[int]] = [[] for _ in first]
    try:
        for _ in range(steps):
            logits = decode_tokens(model, pools, setting, channels, cur, k)
            nxt = logits.argmax(-1).tolist()
            for i, t in enumerate(nxt):
                out[i].append(int(t))
                pools.prefix_len[i] += 1
            cur = [[t] for t in nxt]
    finally:
        pools.prefix_len = base
    return out


def _scores(q: torch.Tensor, k: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``q [b, Hkv, G, X]`` against ``k [u, n, Hkv, X]``, row i against ``k[inv[i]]``:
    ``[b, Hkv, G, n]``. One GEMM per KV head and distinct K, the queries of its rows stacked
    (about 10x faster on a CPU than a per-row product over copies of that K)."""
    b, H, G, X = q.shape
    out = q.new_empty(b, H, G, k.shape[1])
    for j in range(k.shape[0]):
        rows = (inv == j).nonzero().squeeze(1)
        kt = k[j].permute(1, 2, 0).contiguous()                              # [Hkv, X, n]
        qj = q.index_select(0, rows).transpose(0, 1).reshape(H, -1, X)       # [Hkv, rows x G, X]
        out[rows] = torch.bmm(qj, kt).view(H, rows.numel(), G, -1).transpose(0, 1)
    return out


def selection_recall(q, view: DecodeAttention, layer_id: int, chunk: int = 64,
                     rows: torch.Tensor | None = None, with_mass: bool = False, q_label=None):
    """Per (token, query head): attention mass on the tokens the DS selection picks, divided by
    the mass of the true top-k tokens, ``[len(rows), Hq]`` on the CPU (1 for rows that decode
    densely); with the top-p budget, on the part of the selection it keeps (k: the upper bound).
    q: ``[B, Hq, D]``; rows: indices into the batch (default: all B). with_mass: return
    ``(recall, mass)``, mass ``[len(rows), Hq]`` being the selection's share of the whole exact
    attention, not divided by the top-k's (what the server's sampled recall reports,
    attention/recall.py; 1 for dense rows). q_label: ``[B, Hq, D]`` the query the label scores
    read (default q; the unrotated q where q and K are rotated, attention/k_rotation.py).

    The selection is recomputed here in float32 with the reference's maths (label scores, mode
    reduction, sink/recent forcing, top-k) on the same label pool, because ``ops.ds_decode`` does
    not return its indices; it is vectorised over requests (``chunk`` at a time: the float32 K
    gather is ``chunk x ctx x Hkv x D x 4`` bytes) so it also runs at GPU scale.
    """
    p, s = view.p, view.s
    lab_pool = p.label_pool(view.channels.shape[-1], s.label)[layer_id]
    ch = view.channels[layer_id].long()                                   # [Hkv, r]
    B, Hq, D = q.shape
    rows = torch.arange(B, device=q.device) if rows is None else rows.to(q.device).long()
    G = Hq // p.hkv
    kk = view.k_max
    out = torch.ones(rows.numel(), Hq, device=q.device)
    mass = torch.ones(rows.numel(), Hq, device=q.device)
    for b0 in range(0, rows.numel(), chunk):
        idx = rows[b0:b0 + chunk]
        sl = slice(b0, b0 + idx.numel())
        n = view.seq_lens[idx].long()
        nmax = int(n.max())
        if nmax <= kk:
            continue
        # the decode driver's rows of one window share its cache row: gather each row's K once
        req, inv = torch.unique(view.req_idx[idx].long(), return_inverse=True)
        slots = p.req_to_token[req, :nmax].long()                            # [u, n]
        valid = torch.arange(nmax, device=q.device)[None] < n[:, None]       # [b, n]
        k = dequant_kv(p.k[layer_id][slots], p.k_scale)                      # [u, n, Hkv, D] float32
        qb = q[idx].float()                                                  # [b, Hq, D]
        prob = _scores(qb.view(-1, p.hkv, G, D), k, inv).reshape(-1, Hq, nmax)
        del k
        prob = (prob * view.sm_scale).masked_fill(~valid[:, None], float("-inf")).softmax(-1)
        ql = qb if q_label is None else q_label[idx].float()
        qh = torch.gather(ql, 2, ch.repeat_interleave(G, 0)[None].expand(idx.numel(), -1, -1))  # [b, Hq, r]
        lab = lab_pool[slots].float()                                        # [u, n, Hkv, r]
        sc = _scores(qh.view(-1, p.hkv, G, ch.shape[-1]), lab, inv)
        sc = sc.reshape(-1, Hq, nmax) * view.sm_scale
        mode = s.mode_of(layer_id)
        if mode != "per_head":
            sc = sc.view(sc.shape[0], p.hkv, G, nmax)
            sc = sc.sum(2) if mode == "group_sum" else sc.amax(2)
        pos = torch.arange(nmax, device=q.device)[None, None]
        keep = (pos < view.num_sink) | (pos >= (n[:, None, None] - view.num_recent))
        raw = sc
        sc = sc.masked_fill(keep, float("inf")).masked_fill(~valid[:, None], float("-inf"))
        sel = sc.topk(kk, -1).indices
        # top-p: only the kept part of the selection counts (against the same best top-k)
        kept = (keep_mask(raw, sel, n, s.top_p, view.top_p_min, view.num_sink, view.num_recent) if s.top_p
                else torch.ones_like(sel, dtype=torch.bool))
        if sel.shape[1] != Hq:
            sel, kept = sel.repeat_interleave(G, 1), kept.repeat_interleave(G, 1)
        got = (prob.gather(2, sel) * kept).sum(-1)
        best = prob.topk(kk, -1).values.sum(-1)
        dense_rows = (n <= kk)[:, None]
        out[sl] = torch.where(dense_rows, torch.ones_like(got), got / best.clamp_min(1e-30))
        mass[sl] = torch.where(dense_rows, torch.ones_like(got), got)
    return (out.cpu(), mass.cpu()) if with_mass else out.cpu()
