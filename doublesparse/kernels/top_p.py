"""The top-p token budget in batched PyTorch (the engine's CPU path; the kernels' version is
``triton/ds_topp.py``, the reference ``reference.topp_keep_ref``).

After the top-k select each selection row keeps only the smallest part of its selection whose
estimated attention weight (softmax of the label scores over the row's tokens that are not forced)
reaches ``top_p`` of the total, at least ``k_min`` tokens with the forced sink/recent ones, ties
at the threshold kept.
"""

from __future__ import annotations

import torch

FP16_MAX = 65504.0


def keep_mask(scores, top, lens, top_p: float, k_min: int, num_sink: int, num_recent: int):
    """scores: ``[b, R, L]`` float32 label scores (positions past a request's length and the forced
    ones may hold anything); top: ``[b, R, k]`` the selected positions; lens: ``[b]`` int64.
    Returns ``[b, R, k]`` bool: the entries each row attends to."""
    L = scores.shape[-1]
    s = scores.clamp(-FP16_MAX, FP16_MAX).half().float()    # ranked as the kernels store them
    pos = torch.arange(L, device=s.device)[None, None]
    n = lens[:, None, None]
    forced = (pos < num_sink) | (pos >= n - num_recent)
    cand = (pos < n) & ~forced
    m = s.masked_fill(~cand, float("-inf")).amax(-1, keepdim=True)
    z = torch.exp(s - m).masked_fill(~cand, 0.0).sum(-1)                    # [b, R]
    fsel = torch.gather(forced.expand_as(s), 2, top)
    sv = torch.gather(s, 2, top).masked_fill(fsel, float("-inf"))
    w = torch.exp(sv - m)                                                   # 0 where forced
    vs, order = sv.sort(-1, descending=True)
    cum = torch.gather(w, 2, order).cumsum(-1)
    # Tokens scoring at least vs[i]: the count of a descending row's prefix through its ties.
    neg = (-vs).contiguous()
    count = torch.searchsorted(neg, neg, right=True)
    mass = torch.gather(cum, 2, count - 1)
    need = k_min - fsel.sum(-1, keepdim=True)
    ok = (vs > float("-inf")) & (mass >= top_p * z[..., None]) & (count >= need)
    tau = vs.masked_fill(~ok, float("-inf")).amax(-1, keepdim=True)
    return fsel | (sv >= tau)
