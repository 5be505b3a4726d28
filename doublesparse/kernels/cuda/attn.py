"""Host launcher of the CUDA C++ attention over the selected tokens (attn.cu), compiled at run time
by NVRTC (nvrtc.py).

Writes the split-K partials (``ws.part_o``, ``ws.part_lse``) as the Triton decode kernel does, so
the same merge follows. ``why_not`` says why a call cannot take this path (dtypes, alignment,
sizes, NVRTC); ``ds_launch`` then uses Triton. ``attend`` only launches: no host syncs, capturable.
"""

from __future__ import annotations

import math

import torch

from . import nvrtc

NAME = "attn.cu"
KERNELS = ("ds_attn",)
_KTYPE = {torch.bfloat16: 0, torch.float16: 1}


_SMEM = 48 * 1024  # static shared memory a block may use


def _ring_bytes(tokens, stages, warps) -> int:
    """attn.cu's cp.async ring: per thread and step, a K and a V piece of 16 bytes per token."""
    return stages * tokens * 2 * 32 * warps * 16


def _defines(q, k_cache, per_head, tokens, stages, warps, min_blocks):
    Hq, Hkv, D = q.shape[1], k_cache.shape[1], q.shape[2]
    G = Hq // Hkv
    # A program's G query heads' state takes ~32 G registers per lane: fewer blocks past G = 4.
    minb = min_blocks if per_head or G <= 4 else min(min_blocks, 2)
    return (("D", D), ("G", G), ("PER_HEAD", int(per_head)), ("KTYPE", _KTYPE[q.dtype]), ("NT", tokens),
            ("NS", stages), ("NWA", warps), ("MINB", minb))


def why_not(q, k_cache, v_cache, per_head, tokens, stages, warps, min_blocks) -> str | None:
    """None if ``attend`` can run these arguments, else why not (compiles on the first call)."""
    if q.device.type != "cuda":
        return f"device {q.device} is not a CUDA device"
    if q.dtype not in _KTYPE or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return f"q {q.dtype} / caches {k_cache.dtype}, {v_cache.dtype} are not all bf16 or fp16"
    D = q.shape[2]
    if not (8 <= D <= 256 and D & (D - 1) == 0):
        return f"head_dim {D} is not a power of 2 in [8, 256]"
    Hq, Hkv = q.shape[1], k_cache.shape[1]
    if not per_head and Hq // Hkv > 8:
        return f"{Hq // Hkv} query heads per KV head > 8"
    for t in (q, k_cache, v_cache):
        if t.stride(2) != 1 or t.stride(0) % 8 or t.stride(1) % 8 or t.data_ptr() % 16:
            return "q / K / V rows are not whole 16-byte vectors"
    if stages < 2 or _ring_bytes(tokens, stages, warps) > _SMEM:
        return f"{stages} stages of {tokens} tokens x {warps} warps do not fit {_SMEM} bytes of shared memory"
    return nvrtc.unavailable(q.device, NAME, KERNELS, _defines(q, k_cache, per_head, tokens, stages, warps,
                                                               min_blocks))


def attend(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sel, part_o, part_lse, sm_scale, heavy_k,
           threshold, per_head, rows, S, tokens, stages, warps, min_blocks):
    """Partials of the attention over each row's selected slots (``sel``: [B, rows, >= k] int32),
    or over all positions for requests that decode densely. Grid (B, rows, S).

    q: [B, Hq, D]; k_cache, v_cache: [slots, Hkv, D]; part_o: [B, Hq, >= S, D] fp32;
    part_lse: [B, Hq, >= S] fp32 (log2 units).
    """
    B = q.shape[0]
    kern = nvrtc.kernel(q.device, NAME, KERNELS, "ds_attn", _defines(q, k_cache, per_head, tokens, stages, warps,
                                                                     min_blocks))
    kern(grid=(B, rows, S), block=(32 * warps, 1, 1),
         args=[q, k_cache, v_cache, req_to_token, req_idx, int(req_idx.dtype == torch.int64), seq_lens, sel,
               part_o, part_lse, float(sm_scale) * math.log2(math.e),
               *nvrtc.ints("CUDA attention", heavy_k, threshold, 1, q.stride(0), q.stride(1), k_cache.stride(0),
                           k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0),
                           sel.stride(0), sel.stride(1), part_o.stride(0), part_o.stride(1), part_o.stride(2),
                           part_lse.stride(0), part_lse.stride(1), S)])
