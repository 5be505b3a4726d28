"""Weight-based heavy channels, for when no calibrated config is given.

Rule (documented in :func:`default_channels`): a channel's worth is estimated from the q and k
projection rows of the head alone, accounting for RoPE. After RoPE, channel c of a pair (c, c')
holds ``cos(θ) k_c - sin(θ) k_c'``; averaged over positions its energy is (E_c + E_c') / 2, so both
channels of a pair are equally important and we score pairs, not single rows. With the attention
norm's gain folded into the rows, for roughly isotropic inputs

    E_k[g, p] = |W_k[g, c]|^2 + |W_k[g, c']|^2           (pair p of KV head g)
    score[g, p] = sqrt(E_k[g, p]) * sum_{h in group g} sqrt(E_q[h, p])   ("qk", the default)

("k": sqrt(E_k); "q": the group sum alone). Within a pair the channel with the larger own-row
product goes first, which only orders the tie.
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks|layer|h|blk)\.(\d+)\.")
_K_NAMES = ("k_proj", "wk", "attn_k", "key", "to_k")
_Q_NAMES = ("q_proj", "wq", "attn_q", "query", "to_q")
_QKV_NAMES = ("qkv", "qkv_proj", "wqkv", "c_attn", "attn_qkv")
_NORM_NAMES = ("input_layernorm", "input_norm", "attn_norm", "attention_norm", "ln_1", "norm1", "attn_ln")


def _cfg(model):
    c = getattr(model, "config", None)
    if c is None:
        raise ValueError("default_channels needs model.config (num_layers, num_q_heads, num_kv_heads, head_dim)")
    return c


def rope_pairs(head_dim: int, interleaved: bool = False) -> torch.Tensor:
    """Partner channel of each channel: ``[head_dim]`` long.

    HF / rotate-half layout pairs c with c + D/2; GGUF-native (interleaved) pairs 2i with 2i+1.
    """
    c = torch.arange(head_dim)
    if interleaved:
        return c ^ 1
    half = head_dim // 2
    return torch.where(c < half, c + half, c - half)


def _leaf(name: str) -> str:
    parts = name.split(".")
    return parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]


def find_attention_weights(model, num_layers: int) -> dict[int, dict[str, torch.Tensor]]:
    """Per layer ``{"q": [Hq*D, hidden], "k": [Hkv*D, hidden], "norm": [hidden]?}`` from
    ``model.named_parameters()`` / ``named_buffers()`` by common names (HF, GGUF, Meta, GPT-2)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    items = []
    for getter in ("named_parameters", "named_buffers"):
        if hasattr(model, getter):
            items += list(getattr(model, getter)())
    if not items and hasattr(model, "state_dict"):
        items = list(model.state_dict().items())
    for name, t in items:
        m = _LAYER.search("." + name)
        if m is None or not torch.is_tensor(t) or name.endswith(".bias"):
            continue
        layer = int(m.group(1))
        if layer >= num_layers:
            continue
        leaf = _leaf(name).lower()
        slot = out.setdefault(layer, {})
        if t.dim() == 2 and leaf in _QKV_NAMES:
            slot["qkv"] = t
        elif t.dim() == 2 and leaf in _K_NAMES:
            slot["k"] = t
        elif t.dim() == 2 and leaf in _Q_NAMES:
            slot["q"] = t
        elif t.dim() == 1 and leaf in _NORM_NAMES:
            slot["norm"] = t
    return out


def _rows(w: torch.Tensor, heads: int, head_dim: int, hidden: int | None) -> torch.Tensor:
    """Projection weight as ``[heads, head_dim, hidden]`` whichever way it is stored."""
    w = w.detach().float()
    n = heads * head_dim
    if w.shape[0] != n and w.shape[1] == n:
        w = w.t()
    if w.shape[0] != n:
        raise ValueError(f"projection of shape {tuple(w.shape)} does not have {heads}x{head_dim} rows")
    return w.reshape(heads, head_dim, -1)


def default_channels(model, heavy_channel_num: int, channel_type: str = "qk") -> torch.Tensor:
    """Weight-based heavy channels: LongTensor ``[num_layers, Hkv, heavy_channel_num]``.

    See the module docstring for the rule. The RoPE layout is rotate-half unless the model config
    says ``rope_interleaved=True``. Raises ValueError if the q/k projections cannot be found.
    """
    own = getattr(model, "default_heavy_channels", None)
    if callable(own):  # a model whose keys are not per-head projections (MLA's latent)
        return own(heavy_channel_num, channel_type)
    c = _cfg(model)
    L, hq, hkv, D = int(c.num_layers), int(c.num_q_heads), int(c.num_kv_heads), int(c.head_dim)
    r = int(heavy_channel_num)
    if not 0 < r <= D:
        raise ValueError(f"heavy_channel_num must be in [1, {D}] (head_dim), got {heavy_channel_num}")
    if channel_type not in ("q", "k", "qk"):
        raise ValueError(f"channel_type must be 'q', 'k' or 'qk', got {channel_type!r}")
    g = hq // hkv
    partner = rope_pairs(D, bool(getattr(c, "rope_interleaved", False)))
    found = find_attention_weights(model, L)
    out = torch.empty(L, hkv, r, dtype=torch.long)
    for i in range(L):
        ws = found.get(i, {})
        if "qkv" in ws and ("q" not in ws or "k" not in ws):
            w = ws["qkv"].detach().float()
            if w.shape[0] != (hq + 2 * hkv) * D:
                w = w.t()
            ws = dict(ws, q=w[: hq * D], k=w[hq * D: (hq + hkv) * D])
        if "k" not in ws or "q" not in ws:
            raise ValueError(f"default_channels: no q/k projection weights found for layer {i} "
                             f"(looked for parameter names like layers.{i}.*.{{q_proj,k_proj}}.weight); "
                             f"pass a calibrated channel config instead")
        wq = _rows(ws["q"], hq, D, None)
        wk = _rows(ws["k"], hkv, D, None)
        if "norm" in ws and ws["norm"].numel() == wq.shape[-1]:
            gain = ws["norm"].detach().float()
            wq, wk = wq * gain, wk * gain
        eq, ek = wq.pow(2).sum(-1), wk.pow(2).sum(-1)             # [Hq, D], [Hkv, D]
        pq, pk = eq + eq[:, partner], ek + ek[:, partner]         # pair energies, same on both members
        q_grp = pq.sqrt().view(hkv, g, D).sum(1)                  # [Hkv, D]
        own = (eq.sqrt().view(hkv, g, D).sum(1)) * ek.sqrt()      # orders the two members of a pair
        if channel_type == "qk":
            score = pk.sqrt() * q_grp
        elif channel_type == "k":
            score, own = pk.sqrt(), ek.sqrt()
        else:
            score, own = q_grp, eq.sqrt().view(hkv, g, D).sum(1)
        score = score.double() * (1 + 1e-6 * own.double() / (own.double().max() + 1e-30))
        out[i] = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :r]
    return out
