"""Batched pure-PyTorch decode (the engine's CPU path): same semantics as the references, without
their Python loops over requests and heads. Host syncs are fine here (CPU only)."""

from __future__ import annotations

import torch

from .reference import MODES, _group
from .top_p import keep_mask


def _gather(cache, req_to_token, req_idx, L):
    """Rows of the first L positions of every request: [B, L, H, X] float32, and the slots [B, L]."""
    slots = req_to_token[req_idx.long(), :L].long()
    return cache[slots].float(), slots


def _attend(q, k, v, valid, sm_scale):
    """q [B, H, G, D]; k, v [B, H, N, D]; valid [B, H or 1, N] -> [B, H, G, D]."""
    s = torch.einsum("bhgd,bhnd->bhgn", q, k) * sm_scale
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    return torch.einsum("bhgn,bhnd->bhgd", s.softmax(-1), v)


def dense_decode(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale):
    """[B, Hq, D] float32."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = _group(Hq, Hkv)
    L = int(seq_lens.max())
    k, _ = _gather(k_cache, req_to_token, req_idx, L)
    v, _ = _gather(v_cache, req_to_token, req_idx, L)
    valid = (torch.arange(L, device=q.device)[None] < seq_lens[:, None].long())[:, None]
    o = _attend(q.float().view(B, Hkv, G, D), k.transpose(1, 2), v.transpose(1, 2), valid, sm_scale)
    return o.reshape(B, Hq, D)


def label_scores(q, label_cache, label_scale, channels, req_to_token, req_idx, L, sm_scale, mode):
    """The approximate scores of positions 0..L-1 of each request ([b, R, L] float32, R = Hq per
    head, else Hkv; positions past a request's length are not masked) and their cache slots [b, L]."""
    b, Hq, _ = q.shape
    Hkv = label_cache.shape[1]
    G = _group(Hq, Hkv)
    lab, slots = _gather(label_cache, req_to_token, req_idx, L)              # [b, L, Hkv, r]
    if label_cache.dtype == torch.float8_e4m3fn:
        lab = lab * float(label_scale)
    ch = channels.long().repeat_interleave(G, dim=0)                           # [Hq, r]
    qh = torch.gather(q.float(), 2, ch[None].expand(b, -1, -1)).view(b, Hkv, G, -1)
    s = torch.einsum("bhgr,blhr->bhgl", qh, lab) * sm_scale                    # [b, Hkv, G, L]
    if mode == "per_head":
        return s.reshape(b, Hq, L), slots
    return (s.sum(2) if mode == "group_sum" else s.amax(2)), slots


def ds_decode(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token, req_idx,
              seq_lens, sm_scale, heavy_token_nums, mode="group_max", num_sink=0, num_recent=0,
              top_p=0.0, top_p_min_k=0, row_counts=None):
    """heavy_token_nums: [B] int, each request's budget (sparse iff seq_len > it). [B, Hq, D] float32.
    top_p > 0: the top-p budget (kernels/top_p.py); row_counts: an optional [B, R] int32 to fill
    with the tokens each selection row attended to."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    B, Hq, D = q.shape
    lens = seq_lens.long()
    ks = heavy_token_nums.to(lens.device).long()
    sparse = lens > ks
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    if row_counts is not None:
        row_counts.copy_(lens[:, None].expand_as(row_counts))
    if not bool(sparse.all()):
        d = ~sparse
        out[d] = dense_decode(q[d], k_cache, v_cache, req_to_token, req_idx[d], seq_lens[d], sm_scale)
    # One batched pass per distinct budget among the sparse requests (one pass when they share k).
    for k in ks[sparse].unique().tolist():
        rows = sparse & (ks == k)
        out[rows], counts = _sparse_decode(q[rows], k_cache, v_cache, label_cache, label_scale, channels,
                                           req_to_token, req_idx[rows], lens[rows], sm_scale, int(k), mode,
                                           num_sink, num_recent, top_p, top_p_min_k)
        if row_counts is not None:
            row_counts[rows] = counts.to(row_counts.dtype)
    return out


def _sparse_decode(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token, req_idx,
                   lens, sm_scale, k, mode, num_sink, num_recent, top_p=0.0, top_p_min_k=0):
    """Requests that all decode sparsely with one budget k (lens > k): [b, Hq, D] float32, and
    the tokens each selection row attended to [b, R]."""
    b, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = _group(Hq, Hkv)
    L = int(lens.max())
    s, slots = label_scores(q, label_cache, label_scale, channels, req_to_token, req_idx, L, sm_scale, mode)
    raw = s
    pos = torch.arange(L, device=q.device)[None, None]
    n = lens[:, None, None]
    s = s.masked_fill(pos >= n, float("-inf"))
    keep = (pos < num_sink) | ((pos >= n - num_recent) & (pos < n))
    s = s.masked_fill(keep, float("inf"))
    top = s.topk(k, dim=-1).indices                                            # [b, R, k]
    R = top.shape[1]
    sel_slots = torch.gather(slots[:, None, :].expand(-1, R, -1), 2, top)      # [b, R, k]
    heads = torch.arange(R, device=q.device) // (G if R == Hq else 1)          # KV head of each row
    ks = k_cache[sel_slots, heads[None, :, None]].float()                      # [b, R, k, D]
    vs = v_cache[sel_slots, heads[None, :, None]].float()
    qg = q.float().view(b, Hkv, G, D) if R == Hkv else q.float().view(b, Hq, 1, D)
    valid = torch.ones(b, R, k, dtype=torch.bool, device=q.device)
    if top_p > 0:
        valid = keep_mask(raw, top, lens, top_p, top_p_min_k, num_sink, num_recent)
    return _attend(qg, ks, vs, valid, sm_scale).reshape(b, Hq, D), valid.sum(-1)


def rope(positions, q, k, cos, sin):
    """Rotate-half RoPE in float32, rounded once to the input dtype (see ops.rope)."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)

    def rot(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rot(q), rot(k)
