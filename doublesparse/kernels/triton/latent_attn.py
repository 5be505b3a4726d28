"""Triton kernel: split-K decode attention over an MLA latent pool (one cache row per token that is
both key and value; models/mla.py, engine/memory.py ``MemoryPlan.latent``).

A latent row of width D = DN + DR (DeepSeek-V2: 512 compressed + 64 RoPE) is read once per tile
and serves as the key over all D channels and as the value over its first DN channels, which is
all the MLA model reads of the output (``kv_lora_rank`` columns, pushed through W_UV). So the
output's columns from DN on are left unwritten: a latent backend's contract, checked by the model
(``MLAAttention`` requires ``kv_lora_rank <= latent_value_dim(D)``). Every query head of the
request is packed into one program (MLA has one KV head), as in decode_attn.py's GQA packing,
and the token list is the same: positions 0..seq_len-1, or the request's selected slots when it
decodes sparsely (Double Sparsity's selection is shared by all heads). The generic kernel would
hold q, K and V tiles and the accumulator at the next power of two of D (1024 for 576) and read
each row twice; here the two parts are separate power-of-two blocks and V is K's first part.
Partials are merged by decode_attn.py's merge kernel over the first DN channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..latent import latent_split
from .common import INTERPRET
from .decode_attn import tile_slots, merge_kernel


@triton.jit
def latent_attn_kernel(
    q_ptr, kv_ptr, req_to_token_ptr, req_idx_ptr, seq_lens_ptr, sel_ptr, part_o_ptr, part_lse_ptr,
    sm_scale, k_ptr, k_max,
    stride_qb, stride_qh, stride_s, stride_rt, stride_selb,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    G, DN: tl.constexpr, DR: tl.constexpr, HAS_SEL: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    h0 = tl.program_id(2) * BLOCK_H   # this program's block of query heads
    seq_len = tl.load(seq_lens_ptr + b)
    req = tl.load(req_idx_ptr + b).to(tl.int64)
    if HAS_SEL:
        k_b = tl.load(k_ptr + b)
        sparse = seq_len > k_b
        n = tl.where(sparse, tl.minimum(k_b, k_max), seq_len)
    else:
        sparse = seq_len < 0
        n = seq_len
    per_split = tl.cdiv(tl.cdiv(n, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, n)

    heads = h0 + tl.arange(0, BLOCK_H)
    hmask = heads < G
    dn = tl.arange(0, DN)
    dr = DN + tl.arange(0, DR)
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    qn = tl.load(q_row + dn[None, :], mask=hmask[:, None], other=0.0)
    qr = tl.load(q_row + dr[None, :], mask=hmask[:, None], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DN], tl.float32)
    sel_row = sel_ptr + b * stride_selb
    rt_row = req_to_token_ptr + req * stride_rt
    ar = tl.arange(0, BLOCK_N)
    for t in range(start, end, BLOCK_N):
        offs = t + ar
        nmask = offs < end
        slot = tile_slots(sel_row, rt_row, offs, end, sparse, HAS_SEL)
        rows = kv_ptr + slot[:, None] * stride_s
        kn = tl.load(rows + dn[None, :], mask=nmask[:, None], other=0.0)      # [BLOCK_N, DN]: K and V
        kr = tl.load(rows + dr[None, :], mask=nmask[:, None], other=0.0)      # [BLOCK_N, DR]
        if DOT_F32:  # the interpreter computes bf16 dots wrongly
            s = tl.dot(qn.to(tl.float32), tl.trans(kn.to(tl.float32)))
            s += tl.dot(qr.to(tl.float32), tl.trans(kr.to(tl.float32)))
        elif qn.dtype == tl.float32:  # float32 caches (tests): IEEE products, not TF32
            s = tl.dot(qn, tl.trans(kn), input_precision="ieee")
            s = tl.dot(qr, tl.trans(kr), s, input_precision="ieee")
        else:
            s = tl.dot(qn, tl.trans(kn))
            s = tl.dot(qr, tl.trans(kr), s)
        s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            pv = tl.dot(p.to(kn.dtype).to(tl.float32), kn.to(tl.float32))
        elif kn.dtype == tl.float32:
            pv = tl.dot(p, kn, input_precision="ieee")
        else:
            pv = tl.dot(p.to(kn.dtype), kn)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(part_o_ptr + b * stride_pob + heads[:, None] * stride_poh + split * stride_pos + dn[None, :],
             out, mask=hmask[:, None])
    tl.store(part_lse_ptr + b * stride_plb + heads * stride_plh + split, lse, mask=hmask)


def latent_attention(q, kv_cache, req_to_token, req_idx, seq_lens, sm_scale, ws, out, sel, k, k_max,
                     num_splits: int, block_n: int = 32, num_warps: int = 8, num_stages: int = 2,
                     max_heads: int = 64):
    """q: [B, Hq, D]; kv_cache: [S, 1, D] (the latent pool); sel: [B, 1, K] int32 selected slots
    (with k: [B] int32, each request's k) or None. Fills ``out`` [B, Hq, D] (columns < DN) and returns it.
    ``max_heads``: query heads per program (a power of two, at least 16); more run as several
    programs. DeepSeek-V2's 128 heads in one program would need 256 KB of shared memory, over the
    227 KB an sm_90 block may use (`python benchmarks/kernel_resources.py --families`)."""
    B, Hq, D = q.shape
    DN, DR = latent_split(D)
    po, pl = ws.part_o, ws.part_lse
    has_sel = sel is not None
    if out is None:
        out = torch.empty_like(q)
    S = num_splits
    BH = min(max(16, triton.next_power_of_2(Hq)), max(16, triton.next_power_of_2(max_heads)))
    latent_attn_kernel[(B, S, triton.cdiv(Hq, BH))](
        q, kv_cache, req_to_token, req_idx, seq_lens, sel if has_sel else seq_lens, po, pl,
        float(sm_scale), k if has_sel else seq_lens, int(k_max),
        q.stride(0), q.stride(1), kv_cache.stride(0), req_to_token.stride(0), sel.stride(0) if has_sel else 0,
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        Hq, DN=DN, DR=DR, HAS_SEL=has_sel, NUM_SPLITS=S, BLOCK_H=BH,
        BLOCK_N=block_n, DOT_F32=INTERPRET, num_warps=num_warps, num_stages=num_stages,
    )
    merge_kernel[(B, Hq)](
        po, pl, out, po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        out.stride(0), out.stride(1), D=DN, NUM_SPLITS=S, BLOCK_S=triton.next_power_of_2(S), BLOCK_D=DN,
        num_warps=4,
    )
    return out
