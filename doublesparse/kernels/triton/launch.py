"""Host launchers of the store, RoPE and (dense or sparse-list) decode attention kernels: argument
checks, launch geometry, no host syncs. The Double Sparsity decode's launcher is ds_launch.py.

Checks read only shapes, dtypes, strides and devices (common.py), so the launchers stay
capturable in CUDA graphs. Launch geometry depends only on static sizes (batch, heads, the
workspace's max context, the largest top-k) and the ``KernelTuning``, never on seq_lens or
the per-request budgets.
"""

from __future__ import annotations

import math

import torch
import triton

from ..tuning import DEFAULT_TUNING, KernelTuning
from ..workspace import DecodeWorkspace
from .common import (FLOAT, INTERPRET, KV_FP8, check, check_decode, check_rope_tables, check_store_args, fail,
                     kv_scale_args, num_sms, pdl_kwargs)
from .kv_quant import fp8_constexprs
from .decode_attn import decode_attn_kernel, merge_kernel
from ..latent import latent_split
from .latent_attn import latent_attention
from .rope import rope_kernel
from .store import store_kv_kernel


def store_kv(k_cache, v_cache, k, v, slots, label_cache=None, label_scale=None, channels=None, k_scale=None,
             v_scale=None, k_label=None):
    check_store_args(k_cache, v_cache, k, v, slots, label_cache, label_scale, channels, k_scale, v_scale, k_label)
    N, Hkv, D = k.shape
    if N == 0:
        return
    has_label = label_cache is not None
    lab = label_cache if has_label else k_cache
    ch = channels if has_label else slots
    r = label_cache.shape[2] if has_label else 1
    scale = label_scale if (has_label and label_scale is not None) else k_cache
    BLOCK_T = 16
    ksc, vsc, _ = kv_scale_args(k_cache, k_scale, v_scale)
    klab = k if k_label is None else k_label
    store_kv_kernel[(triton.cdiv(N, BLOCK_T), Hkv)](
        k, v, slots, klab, k_cache, v_cache, lab, ch, scale, ksc, vsc, N,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), klab.stride(0), klab.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        lab.stride(0), lab.stride(1), ch.stride(0),
        D=D, R=r, BLOCK_T=BLOCK_T, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_R=triton.next_power_of_2(r), HAS_LABEL=has_label,
        LABEL_FP8=has_label and label_cache.dtype == torch.float8_e4m3fn,
        **fp8_constexprs(k_cache.dtype), INTERPRET=INTERPRET, num_warps=4,
    )


def _attn_block_n(programs_rows: int, device, tuning: KernelTuning) -> int:
    # Few (request, head) rows: short tiles and many splits keep enough loads in flight. Many rows
    # (large batches): long tiles amortize the per-tile softmax work (measured on an H200).
    if programs_rows >= num_sms(device):
        return tuning.attn_block_n_many_rows
    return tuning.attn_block_n


def split_attention(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, ws, out,
                    sel, rows, k, k_max, per_head, num_splits, tuning: KernelTuning, stages=None,
                    row_ks=None, k_scale=None, v_scale=None):
    """Split-K attention (+ merge) over each row's whole cache (``sel`` None) or, for requests
    with ``seq_len > k[b]``, over their ``k[b]`` selected slots (sel: [B, rows, K] int32, k: [B]
    int32 each request's k, at most k_max entries read per row); ``row_ks`` ([B, >= rows]
    int32, the top-p budget): over the first ``row_ks[b, row]`` slots of each row instead.
    k_scale, v_scale: [1] float32, an fp8 pool's scales (the kernel multiplies the scores by k's and
    the output by v's)."""
    B, Hq, D = q.shape
    if v_cache is k_cache and k_cache.shape[1] == 1 and not per_head and latent_split(D):
        if k_cache.dtype in KV_FP8:
            fail("the MLA latent attention reads a bf16/fp16 latent pool, not fp8")
        # an MLA latent pool (V is K's first part): its own kernel (latent_attn.py). It has one
        # selection row per request, so the top-p budget's per-row count is that request's count
        # (the keep kernel fills only the first row_ks[b, 0] entries of sel).
        if row_ks is not None:
            k = row_ks[:, 0].contiguous()
        return latent_attention(q, k_cache, req_to_token, req_idx, seq_lens, sm_scale, ws, out, sel,
                                k, k_max, num_splits, max_heads=tuning.latent_max_heads)
    block_n = _attn_block_n(B * rows, q.device, tuning)
    G = Hq // k_cache.shape[1]
    S = num_splits
    if not 1 <= S <= ws.max_splits:
        fail(f"num_splits={S} must be in [1, {ws.max_splits}]")
    po, pl = ws.part_o, ws.part_lse
    has_sel = sel is not None
    sel_t = sel if has_sel else seq_lens
    if out is None:
        out = torch.empty_like(q)
    block_s = triton.next_power_of_2(S)
    ksc, vsc, kv_fp8 = kv_scale_args(k_cache, k_scale, v_scale)
    decode_attn_kernel[(B, rows, S)](
        q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sel_t, po, pl, out,
        float(sm_scale), k if has_sel else seq_lens, int(k_max),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0), sel.stride(0) if has_sel else 0, sel.stride(1) if has_sel else 0,
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        out.stride(0), out.stride(1),
        G=G, D=D, PER_HEAD=per_head, HAS_SEL=has_sel, NUM_SPLITS=S,
        BLOCK_H=max(16, triton.next_power_of_2(1 if per_head else G)), BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(D), DOT_F32=INTERPRET,
        row_ks_ptr=seq_lens if row_ks is None else row_ks, stride_rkb=0 if row_ks is None else row_ks.stride(0),
        ROW_KS=row_ks is not None, k_scale_ptr=ksc, v_scale_ptr=vsc, KV_FP8=kv_fp8,
        num_warps=tuning.attn_warps, num_stages=stages or tuning.attn_stages,
    )
    merge_kernel[(B, Hq)](
        po, pl, out, po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        out.stride(0), out.stride(1),
        D=D, NUM_SPLITS=S, BLOCK_S=block_s, BLOCK_D=triton.next_power_of_2(D),
        num_warps=4, **pdl_kwargs(q.device, tuning),
    )
    return out


def dense_splits(B: int, Hkv: int, ws: DecodeWorkspace, device, tuning: KernelTuning) -> int:
    want = triton.cdiv(tuning.attn_programs_per_sm * num_sms(device), B * Hkv)
    return max(1, min(ws.max_splits, want, triton.cdiv(ws.max_ctx, _attn_block_n(B * Hkv, device, tuning))))


def sparse_splits(B, rows, Hkv, k_max, ws, dev, tuning: KernelTuning) -> int:
    """Split-K partitions of a row of the attention over the selection, for the bound k_max of
    the batch's k (a row with a smaller one, or a request that decodes densely and reads its
    whole cache, is cut into as many splits of its own length)."""
    want = triton.cdiv(tuning.sparse_attn_programs_per_sm * num_sms(dev), B * rows)
    cap = max(triton.cdiv(k_max, _attn_block_n(B * rows, dev, tuning)), dense_splits(B, Hkv, ws, dev, tuning))
    return max(1, min(ws.max_splits, want, cap))


def dense_decode(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, ws, out=None,
                 num_splits=None, tuning: KernelTuning = DEFAULT_TUNING, k_scale=None, v_scale=None):
    """q: [B, Hq, D]; caches [S, Hkv, D] (fp8 with k_scale, v_scale [1] float32); returns (or
    fills ``out``) [B, Hq, D] in q's dtype."""
    B, Hq, Hkv, D = check_decode(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, ws, out, k_scale, v_scale)
    S = num_splits or dense_splits(B, Hkv, ws, q.device, tuning)
    return split_attention(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, ws, out,
                           None, Hkv, None, 0, False, S, tuning, k_scale=k_scale, v_scale=v_scale)


def attention_lse(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, ws, sel=None, k=None,
                  row_ks=None, per_head=False, tuning: KernelTuning = DEFAULT_TUNING, k_scale=None, v_scale=None):
    """Decode attention and each query head's natural-log log-sum-exp of its scaled scores: ->
    (out [B, Hq, D] in q's dtype, lse [B, Hq] float32). ``sel`` None: over each request's whole
    cache (``seq_lens``); else over the first ``k[b]`` slots of each selection row (``sel`` [B, R,
    K] int32, R = Hkv, or Hq with ``per_head``; ``row_ks`` [B, R] int32: per row instead).
    The kernels keep base-2 partials per split; the merge of their log-sum-exps is a torch op."""
    B, Hq, Hkv, D = check_decode(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, ws, None, k_scale, v_scale)
    if sel is None:
        S = dense_splits(B, Hkv, ws, q.device, tuning)
        out = split_attention(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, sm_scale, ws, None,
                              None, Hkv, None, 0, False, S, tuning, k_scale=k_scale, v_scale=v_scale)
    else:
        R, K = sel.shape[1], sel.shape[2]
        if sel.shape[0] != B or R != (Hq if per_head else Hkv) or k is None or k.shape != (B,):
            fail(f"attention_lse: sel must be [{B}, {Hq if per_head else Hkv}, K] with k [{B}], got "
                 f"{tuple(sel.shape)} and {None if k is None else tuple(k.shape)}")
        S = sparse_splits(B, R, Hkv, K, ws, q.device, tuning)
        # a length of k + 1 with a budget of k: every request reads its selection
        out = split_attention(q, k_cache, v_cache, req_to_token, req_idx, k + 1, sm_scale, ws, None, sel, R, k, K,
                              per_head, S, tuning, row_ks=row_ks, k_scale=k_scale, v_scale=v_scale)
    lse = torch.logsumexp(ws.part_lse[:B, :Hq, :S].float() * math.log(2.0), dim=-1)
    return out, lse


def rope(positions, q, k, cos, sin):
    dev = q.device
    check(q, "q", 3, FLOAT, dev)
    check(k, "k", 3, (q.dtype,), dev)
    T, Hq, D = q.shape
    check_rope_tables("rope", positions, cos, sin, D, dev)
    if k.shape[0] != T or k.shape[2] != D or positions.shape[0] != T:
        fail(f"rope: q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)} disagree")
    qo = torch.empty(q.shape, dtype=q.dtype, device=dev)
    ko = torch.empty(k.shape, dtype=k.dtype, device=dev)
    if T == 0:
        return qo, ko
    Hkv = k.shape[1]
    rope_kernel[(T,)](
        q, k, qo, ko, cos, sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0), qo.stride(1),
        ko.stride(0), ko.stride(1), cos.stride(0),
        HQ=Hq, HKV=Hkv, HALF=D // 2, BLOCK_HQ=triton.next_power_of_2(Hq),
        BLOCK_HKV=triton.next_power_of_2(Hkv), BLOCK_D2=triton.next_power_of_2(D // 2), num_warps=1,
        # no FMA contraction: the rotation rounds as the fused RoPE + store and the reference do,
        # so a backend that rotates apart (DS-Offload) sees the in-GPU path's q and k bit for bit
        enable_fp_fusion=False,
    )
    return qo, ko
