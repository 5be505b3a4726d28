"""Weight-based heavy channels of an MLA latent, for Double Sparsity without a calibrated config.

The engine scores a token by ``q[ch] . latent[ch]`` over r channels of the 576-wide latent row
(``[c_kv | k_rope]``, models/mla.py), one choice shared by all heads. As for GQA models
(channels/weights.py), a channel's worth is estimated from the weights alone, for roughly
isotropic unit-variance inputs to each projection (what the RMS norms before them make of the
activations):

    compressed channel j:  E_k[j] = gain_j^2 * |W_kv_a[j]|^2 / mean_i |W_kv_a[i]|^2   (kv_a_norm)
                           E_q[h, j] = |(W_UK_h^T W_q_nope_h)[j]|^2       (absorbed query, head h)
    RoPE channel c:        E_k[c] = |W_k_rope[c]|^2, E_q[h, c] = |W_q_rope_h[c]|^2, both averaged
                           over c's rotation pair (RoPE mixes the pair across positions)
    score = sqrt(E_k) * sum_h sqrt(E_q)   ("qk"; "k": sqrt(E_k); "q": the head sum alone)

with the input norm's gain folded into the rows. Channels are in the latent's stored order (the
RoPE part in the rotate-half layout the model writes).
"""

from __future__ import annotations

import torch


def _rope_rows(w: torch.Tensor) -> torch.Tensor:
    """[..., dr, X] rows of interleaved RoPE pairs -> rotate-half order (as the model stores them)."""
    dr = w.shape[-2]
    return w.unflatten(-2, (dr // 2, 2)).transpose(-2, -3).flatten(-3, -2)


def _pairs(e: torch.Tensor) -> torch.Tensor:
    """Energies [..., dr] in rotate-half order -> each channel's pair mean."""
    half = e.shape[-1] // 2
    m = (e[..., :half] + e[..., half:]) / 2
    return torch.cat([m, m], dim=-1)


@torch.no_grad()
def mla_channel_scores(attn, input_gain: torch.Tensor, channel_type: str = "qk") -> torch.Tensor:
    """Scores ``[latent_dim]`` float64 of one layer's latent channels (higher: heavier); attn: an
    ``MLAAttention``; input_gain: ``[hidden]`` the layer's input-norm weight."""
    m, nh = attn.mla, attn.num_heads
    g = input_gain.float()
    if m.q_lora_rank is None:
        wq = attn.q_proj.weight.float() * g
    else:  # the low-rank query's norm output is the isotropic input of q_b_proj
        wq = attn.q_b_proj.weight.float() * attn.q_a_norm.weight.float()
    wq = wq.view(nh, m.qk_head_dim, -1)
    wq_nope, wq_rope = wq[:, :m.qk_nope_head_dim], _rope_rows(wq[:, m.qk_nope_head_dim:])
    w_uk = attn.kv_b_proj.weight.float().view(nh, -1, m.kv_lora_rank)[:, :m.qk_nope_head_dim]  # [nh, dn, R]
    q_lat = torch.einsum("hnr,hnx->hrx", w_uk, wq_nope)                                       # [nh, R, X]
    eq = torch.cat([q_lat.pow(2).sum(-1), _pairs(wq_rope.pow(2).sum(-1))], dim=-1)          # [nh, 576]
    wkv = attn.kv_a_proj.weight.float() * g
    ec = wkv[:m.kv_lora_rank].pow(2).sum(-1)
    ec = attn.kv_a_norm.weight.float().pow(2) * ec / ec.mean()
    ek = torch.cat([ec, _pairs(_rope_rows(wkv[m.kv_lora_rank:]).pow(2).sum(-1))])            # [576]
    q_sum = eq.sqrt().sum(0)
    score = {"qk": ek.sqrt() * q_sum, "k": ek.sqrt(), "q": q_sum}.get(channel_type)
    if score is None:
        raise ValueError(f"channel_type must be 'q', 'k' or 'qk', got {channel_type!r}")
    return score.double()


def mla_default_channels(model, heavy_channel_num: int, channel_type: str = "qk") -> torch.Tensor:
    """LongTensor ``[num_layers, 1, r]``: each layer's r heaviest latent channels by
    :func:`mla_channel_scores`."""
    D = model.config.head_dim
    r = int(heavy_channel_num)
    if not 0 < r <= D:
        raise ValueError(f"heavy_channel_num must be in [1, {D}] (the latent width), got {heavy_channel_num}")
    out = [torch.sort(mla_channel_scores(layer.attn, layer.input_norm.weight, channel_type),
                      descending=True, stable=True).indices[:r] for layer in model.layers]
    return torch.stack(out)[:, None, :]
