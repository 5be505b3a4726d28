"""Plain PyTorch references for every kernel, in float32, written for clarity rather than speed.

They are the ground truth for the tests and the pure-PyTorch (CPU) path of the engine. Shapes follow
the data layout of docs/design.md:

    k_cache, v_cache : [S, Hkv, D]            bf16/fp16/fp32, S token slots (slot 0 = padding slot),
                                              or float8_e4m3fn / float8_e5m2 holding k / k_scale, v / v_scale
    k_scale, v_scale : [1] float32            only meaningful for an fp8 K/V pool (its per-layer scales)
    label_cache      : [S, Hkv, r]            bf16, or float8_e4m3fn holding k[channels] / label_scale
    label_scale      : [1] float32            only meaningful for fp8 labels
    channels         : [Hkv, r] int32         heavy channels of each KV head
    req_to_token     : [max_reqs, max_ctx] int32   position -> slot
    req_idx          : [B] int32              row of req_to_token for each batch entry
    seq_lens         : [B] int32              tokens in the cache for each batch entry (>= 1)
    q                : [B, Hq, D]             one new query per batch entry (already RoPE'd)

Selection modes (``mode``):
    "per_head"  : every query head ranks tokens with its own score and takes its own top-k.
    "group_sum" : one top-k per KV head; score = sum over the G query heads of the group.
                  Equals (sum_h q_h[heavy]) . label, so it costs one dot per token.
    "group_max" : one top-k per KV head; score = max over the group's heads, so a token that
                  matters a lot to one head is not outvoted by heads that ignore it.
"""

from __future__ import annotations

import torch

# per_head: a selection per query head; group_*: per KV head, over its query group's scores
# summed or maxed; layer: one selection per request shared by every head of the layer, over the
# sum of all query heads' scores (DS-Offload fetches a token's K/V of all heads as one row)
MODES = ("per_head", "group_sum", "group_max", "layer")


def group_size(hq: int, hkv: int) -> int:
    if hq % hkv != 0:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}")
    return hq // hkv


# fp8 K/V pool dtypes -> their largest finite value (stores clamp to it)
KV_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def is_fp8_kv(cache) -> bool:
    """Whether a K/V pool (or a dtype) holds fp8 values that need a scale."""
    return (cache if isinstance(cache, torch.dtype) else cache.dtype) in KV_FP8_MAX


def quantize_kv(x, dtype, scale):
    """x (any float) as a K/V pool of ``dtype`` stores it: fp8 pools ``x / scale`` ([1] float32)
    clamped to the format's largest value, rounded to nearest even; other dtypes a plain cast."""
    if dtype not in KV_FP8_MAX:
        return x.to(dtype)
    m = KV_FP8_MAX[dtype]
    return (x.float() / scale.float()).clamp(-m, m).to(dtype)


def dequant_kv(rows, scale):
    """Rows of a K/V pool as float32 values: fp8 ones times their scale ([1] float32)."""
    if is_fp8_kv(rows):
        return rows.float() * scale.float()
    return rows.float()


def store_ref(k_cache, v_cache, label_cache, label_scale, k, v, slots, channels, k_scale=None, v_scale=None,
              k_label=None):
    """Write k, v ``[N, Hkv, D]`` into the pools at ``slots [N]`` and the K label (in place). The
    label is taken from the unquantized ``k_label`` ``[N, Hkv, D]`` (default k; the unrotated K
    where the pool holds a rotated one, attention/k_rotation.py), in its own dtype and scale,
    whatever the K pool's."""
    slots = slots.long()
    k_cache[slots] = quantize_kv(k, k_cache.dtype, k_scale)
    v_cache[slots] = quantize_kv(v, v_cache.dtype, v_scale)
    if label_cache is not None:
        store_labels_ref(label_cache, label_scale, k if k_label is None else k_label, slots, channels)


def store_labels_ref(label_cache, label_scale, k, slots, channels) -> None:
    """Write the labels of k ``[N, Hkv, D]`` (its ``channels [Hkv, r]``, fp8 pools scaled by
    ``label_scale``) into ``label_cache`` at ``slots [N]`` (in place)."""
    lab = torch.gather(k.float(), 2, channels.long()[None].expand(k.shape[0], -1, -1))
    if label_cache.dtype == torch.float8_e4m3fn:
        lab = (lab / label_scale.float()).clamp(-448.0, 448.0)
    label_cache[slots.long()] = lab.to(label_cache.dtype)


def gather_tokens(cache, req_to_token, req_idx, b: int, n: int):
    """Rows ``[n, Hkv, X]`` of the first n positions of batch entry b, in float32."""
    slots = req_to_token[req_idx[b].long(), :n].long()
    return cache[slots].float()


def dense_decode_ref(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, k_scale=None,
                     v_scale=None):
    """Exact decode attention (over the dequantized values of an fp8 pool). Returns ``[B, Hq, D]``
    float32."""
    k_cache, v_cache = dequant_kv(k_cache, k_scale), dequant_kv(v_cache, v_scale)
    B, Hq, D = q.shape
    G = group_size(Hq, k_cache.shape[1])
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(seq_lens[b])
        k = gather_tokens(k_cache, req_to_token, req_idx, b, n).repeat_interleave(G, dim=1)
        v = gather_tokens(v_cache, req_to_token, req_idx, b, n).repeat_interleave(G, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * sm_scale
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


def label_scores_ref(q, label_cache, label_scale, channels, req_to_token, req_idx, seq_lens, mode,
                     sm_scale, max_len=None):
    """Approximate scores ``sm_scale * q[heavy] . label`` for every cached token.

    Returns ``[B, R, max_len]`` float32 with -inf past each seq_len; R = Hq for "per_head", 1 for
    "layer", else Hkv.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    B, Hq, D = q.shape
    Hkv = label_cache.shape[1]
    G = group_size(Hq, Hkv)
    max_len = int(seq_lens.max()) if max_len is None else max_len
    R = Hq if mode == "per_head" else 1 if mode == "layer" else Hkv
    out = torch.full((B, R, max_len), float("-inf"), dtype=torch.float32, device=q.device)
    ch = channels.long().repeat_interleave(G, dim=0)                       # [Hq, r]
    qh = torch.gather(q.float(), 2, ch[None].expand(B, -1, -1))            # [B, Hq, r]
    scale = float(label_scale) if label_cache.dtype == torch.float8_e4m3fn else 1.0
    for b in range(B):
        n = int(seq_lens[b])
        lab = gather_tokens(label_cache, req_to_token, req_idx, b, n) * scale  # [n, Hkv, r]
        lab = lab.repeat_interleave(G, dim=1)                                # [n, Hq, r]
        s = torch.einsum("hr,nhr->hn", qh[b], lab) * sm_scale                # [Hq, n]
        if mode == "group_sum":
            s = s.view(Hkv, G, n).sum(1)
        elif mode == "group_max":
            s = s.view(Hkv, G, n).amax(1)
        elif mode == "layer":
            s = s.sum(0, keepdim=True)
        out[b, :, :n] = s
    return out


def force_keep(scores, seq_lens, num_sink: int, num_recent: int, value: float = float("inf")):
    """Raise the first ``num_sink`` and last ``num_recent`` positions so they are always selected."""
    scores = scores.clone()
    for b in range(scores.shape[0]):
        n = int(seq_lens[b])
        if num_sink:
            scores[b, :, : min(num_sink, n)] = value
        if num_recent:
            scores[b, :, max(0, n - num_recent): n] = value
    return scores


def topk_ref(scores, k: int):
    """Positions of the k largest scores per row: ``[B, R, k]`` int64 (order unspecified)."""
    return torch.topk(scores, k, dim=-1).indices


def sparse_decode_ref(q, k_cache, v_cache, req_to_token, req_idx, positions, sm_scale, keep=None,
                      k_scale=None, v_scale=None):
    """Exact attention over selected positions only.

    positions: ``[B, R, n]`` int; R = Hq (each query head its own set), Hkv (shared by the group)
    or 1 (shared by the layer).
    keep: optional ``[B, R, n]`` bool, the entries each row attends to (default: all n).
    Returns ``[B, Hq, D]`` float32.
    """
    k_cache, v_cache = dequant_kv(k_cache, k_scale), dequant_kv(v_cache, v_scale)
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = group_size(Hq, Hkv)
    R = positions.shape[1]
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        row = req_to_token[req_idx[b].long()].long()
        for h in range(Hq):
            kvh = h // G
            r = kvh if R == Hkv else h if R == Hq else 0
            pos = positions[b, r].long()
            if keep is not None:
                pos = pos[keep[b, r]]
            slots = row[pos]
            k = k_cache[slots, kvh].float()
            v = v_cache[slots, kvh].float()
            p = (k @ q[b, h].float() * sm_scale).softmax(-1)
            out[b, h] = p @ v
    return out


def is_sparse(seq_lens, k):
    """Per request: decode sparsely iff its length exceeds its own k, seq_len > k.

    seq_lens, k: ``[B]`` int (a dense request may carry any k >= seq_len, e.g.
    attention.budget.DENSE). Returns ``[B]`` bool on seq_lens' device.
    """
    return seq_lens.long() > k.to(seq_lens.device).long()


def topp_keep_ref(scores, positions, seq_len: int, top_p: float, k_min: int, num_sink: int = 0,
                  num_recent: int = 0):
    """Which of one row's selected tokens the top-p budget keeps: ``[k]`` bool.

    scores: ``[>= seq_len]`` the row's label scores (as label_scores_ref, not forced); they are
    ranked as the kernels store them (fp16, clamped to +-65504). positions: ``[k]`` the row's
    selection (forced sink/recent positions and the top of the rest). The estimated attention
    weights are ``softmax(scores)`` over the row's tokens that are not forced (the forced ones'
    scores are not kept, and they are attended to anyway). The kept set is every forced position
    plus the selected tokens whose score is at least tau, the largest selected score at which
    (a) the kept tokens' weight reaches top_p of the total and (b) at least k_min tokens, forced
    ones included, are kept; where no score satisfies both, the whole selection. Ties at tau are
    all kept, so a row keeps the smallest such set up to ties.
    """
    s = scores[:seq_len].double().clamp(-65504.0, 65504.0).half().double()
    idx = torch.arange(seq_len, device=s.device)
    forced = (idx < num_sink) | (idx >= seq_len - num_recent)
    m = s[~forced].max()
    z = torch.exp(s[~forced] - m).sum()
    pos = positions.long().to(s.device)
    fsel = forced[pos]
    sv = s[pos]
    w = torch.where(fsel, 0.0, torch.exp(sv - m))
    ge = sv[None, :] >= sv[:, None]            # [i, j]: token j scores at least token i
    ge &= ~fsel[None, :]
    mass = (ge * w[None, :]).sum(1)
    count = ge.sum(1) + int(fsel.sum())
    ok = ~fsel & (mass >= top_p * z) & (count >= k_min)
    tau = sv[ok].max() if bool(ok.any()) else float("-inf")
    return (fsel | (sv >= tau)).to(positions.device)


def ds_decode_ref(q, k_cache, v_cache, label_cache, label_scale, channels, req_to_token, req_idx,
                  seq_lens, sm_scale, k, mode: str = "group_max",
                  num_sink: int = 0, num_recent: int = 0, top_p: float = 0.0, top_p_min_k: int = 0,
                  k_scale=None, v_scale=None):
    """The whole Double Sparsity decode: score, select each request's own top-k, attend; requests
    with ``seq_len <= k[b]`` decode densely. k: ``[B]`` int, each request's k.
    top_p > 0: each selection row then attends only to what :func:`topp_keep_ref` keeps of its
    selection (at least ``top_p_min_k`` tokens). k_scale, v_scale: an fp8 pool's scales."""
    k_cache, v_cache = dequant_kv(k_cache, k_scale), dequant_kv(v_cache, v_scale)
    dense = dense_decode_ref(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale)
    sparse_rows = is_sparse(seq_lens, k)
    if not bool(sparse_rows.any()):
        return dense
    scores = label_scores_ref(q, label_cache, label_scale, channels, req_to_token, req_idx,
                              seq_lens, mode, sm_scale)
    scores = force_keep(scores, seq_lens, num_sink, num_recent)
    out = dense.clone()
    for b in sparse_rows.nonzero().flatten().tolist():
        pos = topk_ref(scores[b: b + 1], int(k[b]))
        keep = None
        if top_p > 0:
            n = int(seq_lens[b])
            raw = label_scores_ref(q[b: b + 1], label_cache, label_scale, channels, req_to_token,
                                   req_idx[b: b + 1], seq_lens[b: b + 1], mode, sm_scale)[0]
            keep = torch.stack([topp_keep_ref(raw[r], pos[0, r], n, top_p, top_p_min_k, num_sink, num_recent)
                                for r in range(pos.shape[1])])[None]
        out[b] = sparse_decode_ref(q[b: b + 1], k_cache, v_cache, req_to_token, req_idx[b: b + 1], pos,
                                   sm_scale, keep)[0]
    return out


# ------------------------------------------------------------- fused layer steps (kernels/triton/fused.py)
# Unlike the attention references above these return the activation dtype: where the kernels
# round is part of what they compute (one rounding of fp32 math, the residual rounded first).

def rmsnorm_ref(x, weight, eps: float):
    """``x / rms(x) * weight`` over the last dim in float32, rounded once to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def add_rmsnorm_ref(x, residual, weight, eps: float):
    """``(rmsnorm(x + residual) * weight, x + residual)``; the sum is rounded to x's dtype before
    the statistics are taken (what the unfused add-then-norm does)."""
    s = (x.float() + residual.float()).to(x.dtype)
    return rmsnorm_ref(s, weight, eps), s


def silu_mul_ref(x):
    """x: [T, 2I] (gate | up) -> ``silu(gate) * up`` [T, I], fp32 math rounded once."""
    g, u = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(x.dtype)


def rope_ref(positions, x, cos, sin):
    """Rotate-half RoPE of x ``[T, H, D]`` at ``positions [T]`` with tables ``[P, D/2]`` float32;
    fp32 math, rounded once to x's dtype."""
    c = cos[positions.long()].unsqueeze(1)
    s = sin[positions.long()].unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rope_store_ref(positions, q, k, v, cos, sin, k_cache, v_cache, slots, label_cache=None,
                   label_scale=None, channels=None, k_scale=None, v_scale=None, qk_norm=None):
    """(Per-head RMSNorm of q and k with ``qk_norm = (q_weight [D], k_weight [D], eps)``, each
    rounded to its dtype,) RoPE of q and k, then :func:`store_ref` of the rotated k (with its
    label) and v. Returns the rotated ``(q [T, Hq, D], k [T, Hkv, D])`` in q's dtype."""
    if qk_norm is not None:
        qn, kn, eps = qk_norm
        q, k = rmsnorm_ref(q, qn, eps), rmsnorm_ref(k, kn, eps)
    qr, kr = rope_ref(positions, q, cos, sin), rope_ref(positions, k, cos, sin)
    store_ref(k_cache, v_cache, label_cache, label_scale, kr, v, slots, channels, k_scale, v_scale)
    return qr, kr


def moe_experts_ref(x, w13, w2, weights, ids, shared=None, shared_w13=None, shared_w2=None):
    """The routed experts of one MoE layer, one (token, expert) assignment at a time in float32.
    x: [T, H]; w13: [E, 2I, H] (gate rows, then up rows); w2: [E, H, I]; weights: [T, K] float;
    ids: [T, K] int; shared: [T, H] or None (added); shared_w13 [2Is, H], shared_w2 [H, Is] or
    None: the shared experts' MLP (added, every token) -> [T, H] float32,
    ``sum_k weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))``, e = ids[t, k]."""
    T, K = ids.shape

    def mlp(gate_up, down, xt):
        i = gate_up.shape[0] // 2
        return down.float() @ (torch.nn.functional.silu(gate_up[:i].float() @ xt) * (gate_up[i:].float() @ xt))

    y = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    for t in range(T):
        xt = x[t].float()
        for k in range(K):
            e = int(ids[t, k])
            y[t] += float(weights[t, k]) * mlp(w13[e], w2[e], xt)
        if shared_w13 is not None:
            y[t] += mlp(shared_w13, shared_w2, xt)
    return y if shared is None else y + shared.float()


def moe_route_ref(logits, top_k: int, renorm: bool, scale: float = 1.0):
    """An MoE router's greedy top-k, one token at a time: logits [T, E] -> (weights [T, top_k]
    float32: the top_k of softmax(logits) in float32, in descending order, divided by their sum if
    ``renorm``, times ``scale``; ids [T, top_k] int64, ties to the lowest expert id)."""
    T = logits.shape[0]
    w = torch.zeros(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.zeros(T, top_k, dtype=torch.int64, device=logits.device)
    for t in range(T):
        p = logits[t].float().softmax(-1)
        order = sorted(range(p.numel()), key=lambda e: (-float(p[e]), e))[:top_k]
        w[t] = p[order]
        ids[t] = torch.tensor(order)
        if renorm:
            w[t] = w[t] / w[t].sum()
    return w * scale, ids


def mla_absorb_ref(q, kv, positions, cos, sin, w_uk, norm_weight, eps: float, q_scale: float):
    """MLA's absorbed query and latent row in float32, rounded once: q [T, nh, dn + dr], kv
    [T, R + dr] (RoPE pairs interleaved), w_uk [nh, dn, R] -> (``[q_nope W_UK | rope(q_rope)] *
    q_scale`` [T, nh, R + dr], ``[rmsnorm(c_kv) | rope(k_rope)]`` [T, 1, R + dr]), :func:`rope_ref`
    over the pairs reordered to rotate-half."""
    dn, R = w_uk.shape[1], w_uk.shape[2]

    def pairs(x):  # interleaved pairs (2i, 2i + 1) -> rotate-half order (i, i + dr / 2)
        return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)

    q_lat = torch.einsum("thd,hdr->thr", q[..., :dn].float(), w_uk.float())
    q_rope = rope_ref(positions, pairs(q[..., dn:].float()), cos, sin)          # float32 in and out
    qo = (torch.cat([q_lat, q_rope], dim=-1) * q_scale).to(q.dtype)
    k_rope = rope_ref(positions, pairs(kv[:, None, R:]), cos, sin)            # rounded to kv's dtype
    return qo, torch.cat([rmsnorm_ref(kv[:, :R], norm_weight, eps)[:, None], k_rope], dim=-1)


def mla_unabsorb_ref(out, w_uv):
    """out [T, nh, >= R], w_uv [nh, dv, R] -> ``o[t, h * dv + j] = sum_r out[t, h, r] w_uv[h, j, r]``
    [T, nh * dv] in float32, rounded once to out's dtype."""
    R = w_uv.shape[2]
    o = torch.einsum("thr,hjr->thj", out[..., :R].float(), w_uv.float())
    return o.reshape(out.shape[0], -1).to(out.dtype)

