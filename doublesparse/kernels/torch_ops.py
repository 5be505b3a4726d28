"""Pure-PyTorch decode (the engine's CPU path): same semantics as the references, without their
Python loops over heads. Host syncs are fine here (CPU only).

Decode on a CPU is bound by per-op overhead and by gathers, not by arithmetic, so each request is
handled on its own with as few ops as possible: its cached rows are a slice of the pool when its
slots are consecutive (the usual case: a request's prompt gets a run of free slots and decode
appends to it), else one ``index_select``; the selected K/V rows are one ``index_select`` each
over the pool seen as ``[S * Hkv, D]``; scores and outputs are batched matmuls over the KV heads
on strided views, with no copies of the cache.
"""

from __future__ import annotations

import torch

from .reference import group_size, is_fp8_kv
from .top_p import keep_mask


def token_rows(req_to_token, row: int, n: int):
    """``(start, None)`` when positions 0..n-1 of request row ``row`` sit in the consecutive slots
    start..start+n-1, else ``(None, slots [n] int64)``."""
    slots = req_to_token[row, :n]
    s0 = int(slots[0])
    if int(slots[-1]) - s0 == n - 1 and (n < 3 or bool((slots[1:] - slots[:-1] == 1).all())):
        return s0, None
    return None, slots.long()


def _rows(cache, start, slots, n: int) -> torch.Tensor:
    """A request's rows ``[n, H, X]`` of a pool: a view when they are consecutive."""
    return cache[start:start + n] if slots is None else cache.index_select(0, slots)


def attend(q, k, v, sm_scale, valid=None, scales=(1.0, 1.0)):
    """q [H, G, D]; k, v [H, N, D] (any strides; fp8 rows times ``scales`` = (k's, v's) host
    floats); valid: None or [H, N] bool (the entries attended to) -> [H, G, D] float32."""
    s = torch.matmul(q, k.float().transpose(1, 2)).mul_(sm_scale * scales[0])
    if valid is not None:
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
    o = torch.matmul(s.softmax(-1), v.float())
    return o if scales[1] == 1.0 else o.mul_(scales[1])


def kv_scales(k_cache, k_scale, v_scale) -> tuple[float, float]:
    """(k's, v's) dequantization factors as host floats: an fp8 pool's scales, else 1."""
    if not is_fp8_kv(k_cache):
        return 1.0, 1.0
    if k_scale is None or v_scale is None:
        raise ValueError("an fp8 K/V pool needs k_scale and v_scale ([1] float32)")
    return float(k_scale), float(v_scale)


def dense_decode(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, k_scale=None, v_scale=None):
    """[B, Hq, D] float32; k_scale, v_scale: [1] float32, an fp8 pool's scales."""
    sc = kv_scales(k_cache, k_scale, v_scale)
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = group_size(Hq, Hkv)
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    for b, (row, n) in enumerate(zip(req_idx.tolist(), seq_lens.tolist())):
        start, slots = token_rows(req_to_token, row, n)
        k = _rows(k_cache, start, slots, n).transpose(0, 1)                    # [Hkv, n, D]
        v = _rows(v_cache, start, slots, n).transpose(0, 1)
        out[b] = attend(q[b].float().view(Hkv, G, D), k, v, sm_scale, scales=sc).view(Hq, D)
    return out


def attention_lse(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, sel=None, k=None,
                  row_ks=None, per_head=False, k_scale=None, v_scale=None):
    """See ops.attention_lse: (out [B, Hq, D] float32, lse [B, Hq] float32, natural log)."""
    ksc, vsc = kv_scales(k_cache, k_scale, v_scale)
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = group_size(Hq, Hkv)
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    for b in range(B):
        for h in range(Hq):
            kvh = h // G
            if sel is None:
                slots = req_to_token[int(req_idx[b]), :int(seq_lens[b])].long()
            else:
                r = h if per_head else kvh
                n = int(row_ks[b, r]) if row_ks is not None else int(k[b])
                slots = sel[b, r, :n].long()
            kk = k_cache[slots, kvh].float() * ksc
            vv = v_cache[slots, kvh].float() * vsc
            sc = (kk @ q[b, h].float()) * sm_scale
            lse[b, h] = torch.logsumexp(sc, 0)
            out[b, h] = torch.softmax(sc, 0) @ vv
    return out, lse


def label_scores(q, label_cache, label_scale, channels, start, slots, n: int, sm_scale, mode):
    """One request's approximate scores of its n cached tokens: [R, n] float32 (R = Hq per head,
    1 for the layer mode, else Hkv). q: [Hq, D]; (start, slots) as from :func:`token_rows`."""
    Hq = q.shape[0]
    Hkv = label_cache.shape[1]
    G = group_size(Hq, Hkv)
    lab = _rows(label_cache, start, slots, n).float()                          # [n, Hkv, r]
    if label_cache.dtype == torch.float8_e4m3fn:
        lab = lab * float(label_scale)
    ch = channels.long().repeat_interleave(G, dim=0)                           # [Hq, r]
    qh = torch.gather(q.float(), 1, ch).view(Hkv, G, -1)                       # [Hkv, G, r]
    s = torch.matmul(qh, lab.permute(1, 2, 0)).mul_(sm_scale)                  # [Hkv, G, n]
    if mode == "per_head":
        return s.view(Hq, n)
    if mode == "layer":
        return s.sum((0, 1)).view(1, n)
    return s.sum(1) if mode == "group_sum" else s.amax(1)


def select(q, label_cache, label_scale, channels, start, slots, n: int, k: int, sm_scale, mode,
           num_sink=0, num_recent=0, top_p=0.0, top_p_min_k=0):
    """One sparse request's selection: ``(sel [R, k] int64 cache slots, valid [R, k] bool or None)``
    (R = Hq per head, else Hkv: the layer mode's one row repeated for each; valid: the entries the
    top-p budget keeps, None without it). q: [Hq, D]; (start, slots) as from :func:`token_rows`;
    n > k tokens."""
    s = label_scores(q, label_cache, label_scale, channels, start, slots, n, sm_scale, mode)
    raw = s.clone() if top_p > 0 else None
    if num_sink:
        s[:, :num_sink] = float("inf")
    if num_recent:
        s[:, n - num_recent:] = float("inf")
    top = s.topk(k, dim=-1, sorted=False).indices                              # [R, k] positions
    if mode == "layer":                                                        # one row for every KV head
        Hkv = label_cache.shape[1]
        top, raw = top.expand(Hkv, k), None if raw is None else raw.expand(Hkv, n)
    sel = top + start if slots is None else slots[top]                         # [R, k] slots
    valid = None
    if top_p > 0:
        valid = keep_mask(raw[None], top[None], torch.tensor([n], device=q.device), top_p, top_p_min_k,
                          num_sink, num_recent)[0]                             # [R, k] bool
    return sel, valid


def ds_decode(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token, req_idx,
              seq_lens, sm_scale, args, row_counts=None, k_scale=None, v_scale=None, q_label=None):
    """args: an ops.DSDecodeArgs (``args.k`` [B] int: each request's k, sparse iff seq_len > it;
    ``k_max`` and ``tuning`` are not read; the top-p budget: kernels/top_p.py). [B, Hq, D]
    float32. k_scale, v_scale: [1] float32, an fp8 pool's scales. row_counts: an optional [B, R]
    int32 to fill with the tokens each selection row attended to. q_label: [B, Hq, D], the
    query the selection reads (default q; ops.ds_decode)."""
    mode, num_sink, num_recent, top_p, top_p_min_k = (args.mode, args.num_sink, args.num_recent, args.top_p,
                                                      args.top_p_min_k)
    sc = kv_scales(k_cache, k_scale, v_scale)
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = group_size(Hq, Hkv)
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    if row_counts is not None:
        row_counts.copy_(seq_lens.long()[:, None].expand_as(row_counts).to(row_counts.dtype))
    for b, (row, n, k) in enumerate(zip(req_idx.tolist(), seq_lens.tolist(), args.k.tolist())):
        start, slots = token_rows(req_to_token, row, n)
        if n <= k:
            kk = _rows(k_cache, start, slots, n).transpose(0, 1)
            vv = _rows(v_cache, start, slots, n).transpose(0, 1)
            out[b] = attend(q[b].float().view(Hkv, G, D), kk, vv, sm_scale, scales=sc).view(Hq, D)
            continue
        sel, valid = select((q if q_label is None else q_label)[b], label_cache, label_scale, channels, start, slots, n, k, sm_scale, mode,
                            num_sink, num_recent, top_p, top_p_min_k)
        R = sel.shape[0]
        heads = torch.arange(R, device=q.device) // (G if R == Hq else 1)
        flat = (sel * Hkv + heads[:, None]).view(-1)                           # rows of [S * Hkv, D]
        kk = k_cache.view(-1, D).index_select(0, flat).view(R, k, D)
        vv = v_cache.view(-1, D).index_select(0, flat).view(R, k, D)
        qg = q[b].float().view(R, Hq // R, D)
        out[b] = attend(qg, kk, vv, sm_scale, valid, sc).view(Hq, D)
        if row_counts is not None:
            row_counts[b] = k if valid is None else valid.sum(-1).to(row_counts.dtype)
    return out


def rope(positions, q, k, cos, sin):
    """Rotate-half RoPE in float32, rounded once to the input dtype (see ops.rope)."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)

    def rot(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rot(q), rot(k)
