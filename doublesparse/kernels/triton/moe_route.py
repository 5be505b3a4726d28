"""An MoE router's softmax -> top-k -> renormalise -> scale in one launch (models/moe.py's ``route``
for plain greedy top-k). At decode sizes those five or six small device ops cost more launch gaps
than work; one program per token does them in registers, in float32.

The top-k is k rounds of "take the largest, mask it": ties go to the lowest expert id, and the k
come out in descending order of weight, as ``torch.topk`` returns them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROUTE_MAX_EXPERTS = 1024  # one program holds a token's logits in registers


@triton.jit
def _moe_route_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_l, scale,
                  K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    emask = e < E
    x = tl.load(logits_ptr + t.to(tl.int64) * stride_l + e, mask=emask, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(emask, p / tl.sum(p, axis=0), -1.0)  # softmax; -1 below every probability
    kk = tl.arange(0, KP)  # K rounded up to a power of two; the rest stay 0 and are not stored
    top_w = tl.zeros([KP], tl.float32)
    top_i = tl.zeros([KP], tl.int32)
    for k in tl.static_range(K):
        m = tl.max(p, axis=0)
        i = tl.min(tl.where(p == m, e, BLOCK_E), axis=0)
        top_w = tl.where(kk == k, m, top_w)
        top_i = tl.where(kk == k, i, top_i)
        p = tl.where(e == i, -2.0, p)
    if RENORM:
        top_w = top_w / tl.sum(top_w, axis=0)
    tl.store(w_ptr + t * K + kk, top_w * scale, mask=kk < K)
    tl.store(ids_ptr + t * K + kk, top_i.to(tl.int64), mask=kk < K)


def route_topk(logits: torch.Tensor, top_k: int, renorm: bool, scale: float = 1.0):
    """logits: [T, E] (any float dtype, last dim contiguous) -> (weights [T, top_k] float32,
    ids [T, top_k] int64): softmax over E in float32, the top_k, divided by their sum if
    ``renorm``, times ``scale``."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [T, E] with a contiguous last dim, got {tuple(logits.shape)}")
    T, E = logits.shape
    if not 1 <= top_k <= E or E > ROUTE_MAX_EXPERTS:
        raise ValueError(f"top_k {top_k} of {E} experts: need 1 <= top_k <= E <= {ROUTE_MAX_EXPERTS}")
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        _moe_route_kernel[(T,)](logits, w, ids, E, logits.stride(0), float(scale), K=top_k,
                            KP=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E),
                            RENORM=bool(renorm), num_warps=4)
    return w, ids
