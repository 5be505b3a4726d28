"""The absorbed MLA layer's small steps around attention in one launch each (models/mla.py), for
decode-sized batches, where their ~10 separate device ops (norm, two RoPE reorders, RoPE, a
batched GEMM with its layout copies, two concatenations, a scale) cost more in launch gaps than
in bytes.

* :func:`mla_absorb`: ``q = [q_nope W_UK | rope(q_rope)] * q_scale`` per head and the latent row
  ``[rmsnorm(c_kv) | rope(k_rope)]``; the checkpoint's interleaved RoPE pairs are read as pairs
  (the reorder to rotate-half is in the indexing), everything in float32, rounded once.
* :func:`mla_unabsorb`: ``o[t, h * dv + j] = sum_r out[t, h, r] W_UV[h, j, r]``, written in the
  layout o_proj reads.

Programs are (head, column tile); each streams its head's W_UK / W_UV tile once for every token
(tiles of 16 token rows, tl.dot's minimum), so the weights are read once per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..latent import MLA_PROJ_MAX_TOKENS as MAX_TOKENS
from .common import FLOAT, check, check_rope_tables, fail
_BT = 16           # token rows per tile
_BC = 64           # output columns per program: R = 512 -> 8 programs per head (sm_90: 64 registers,
_BK = 32           # no spills; 128-wide tiles of per-element pointers took 255 and spilled)


@triton.jit
def _dot(a, b, acc):
    if a.dtype == tl.float32:  # float32 tests: IEEE products, not TF32
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _rope_pairs(src, dst, pos_ptr, cos_ptr, sin_ptr, s_cos, t, tmask, scale,
                HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """dst[:, i] = x1 c - x2 s, dst[:, HALF + i] = x2 c + x1 s (times scale) for the pairs
    (x1, x2) = src[:, 2i], src[:, 2i + 1]; src, dst: [rows, 1] row pointers."""
    i = tl.arange(0, BLOCK_HALF)
    m = tmask[:, None] & (i < HALF)[None, :]
    pos = tl.load(pos_ptr + t, mask=tmask, other=0).to(tl.int64)
    cs = tl.load(cos_ptr + pos[:, None] * s_cos + i[None, :], mask=m, other=0.0)
    sn = tl.load(sin_ptr + pos[:, None] * s_cos + i[None, :], mask=m, other=0.0)
    x1 = tl.load(src + 2 * i[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + 2 * i[None, :] + 1, mask=m, other=0.0).to(tl.float32)
    tl.store(dst + i[None, :], ((x1 * cs - x2 * sn) * scale).to(dst.dtype.element_ty), mask=m)
    tl.store(dst + HALF + i[None, :], ((x2 * cs + x1 * sn) * scale).to(dst.dtype.element_ty), mask=m)


@triton.jit
def mla_absorb_kernel(q_ptr, kv_ptr, pos_ptr, cos_ptr, sin_ptr, wuk_ptr, nw_ptr, qo_ptr, lat_ptr,
                      T, eps, q_scale,
                      s_qt, s_qh, s_kvt, s_cos, s_wh, s_wn, s_qot, s_qoh, s_lt,
                      DN: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr, NH: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
                      BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, LT: tl.constexpr):
    h = tl.program_id(0)      # a query head, or NH: the latent rows
    c0 = tl.program_id(1) * BC
    if h < NH:
        c = c0 + tl.arange(0, BC)
        kk = tl.arange(0, BK)
        for t0 in range(0, T, BT):
            t = t0 + tl.arange(0, BT)
            tmask = t < T
            qrow = q_ptr + t[:, None].to(tl.int64) * s_qt + h * s_qh
            # q_nope [BT, DN] @ W_UK[h][:, c0:c0+BC], BK input channels at a time
            acc = tl.zeros([BT, BC], tl.float32)
            for k0 in range(0, DN, BK):
                k = k0 + kk
                a = tl.load(qrow + k[None, :], mask=tmask[:, None] & (k[None, :] < DN), other=0.0)
                w = tl.load(wuk_ptr + h * s_wh + k[:, None] * s_wn + c[None, :],
                            mask=(k[:, None] < DN) & (c[None, :] < R), other=0.0)
                acc = _dot(a, w, acc)
            orow = qo_ptr + t[:, None].to(tl.int64) * s_qot + h * s_qoh
            tl.store(orow + c[None, :], (acc * q_scale).to(qo_ptr.dtype.element_ty),
                     mask=tmask[:, None] & (c[None, :] < R))
            if c0 == 0:  # the rope part, pairs (2i, 2i + 1) -> (i, i + HALF)
                _rope_pairs(qrow + DN, orow + R, pos_ptr, cos_ptr, sin_ptr, s_cos, t, tmask, q_scale,
                            HALF, BLOCK_HALF)
    elif c0 == 0:
        # the latent rows, LT at a time: rmsnorm(c_kv) (float32 statistics, the weight in float32)
        # | rope(k_rope)
        r = tl.arange(0, BLOCK_R)
        nw = tl.load(nw_ptr + r, mask=r < R, other=0.0).to(tl.float32)
        for u0 in range(0, T, LT):
            u = u0 + tl.arange(0, LT)
            umask = u < T
            rm = umask[:, None] & (r[None, :] < R)
            krow = kv_ptr + u[:, None].to(tl.int64) * s_kvt
            x = tl.load(krow + r[None, :], mask=rm, other=0.0).to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / R + eps)
            lrow = lat_ptr + u[:, None].to(tl.int64) * s_lt
            tl.store(lrow + r[None, :], (x * inv[:, None] * nw[None, :]).to(lat_ptr.dtype.element_ty), mask=rm)
            _rope_pairs(krow + R, lrow + R, pos_ptr, cos_ptr, sin_ptr, s_cos, u, umask, 1.0, HALF, BLOCK_HALF)


@triton.jit
def mla_unabsorb_kernel(a_ptr, wuv_ptr, o_ptr, T, s_at, s_ah, s_wh, s_wj, s_ot,
                        R: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                        BK: tl.constexpr):
    h = tl.program_id(0)
    j = tl.program_id(1) * BC + tl.arange(0, BC)
    jmask = j < DV
    kk = tl.arange(0, BK)
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        tmask = t < T
        acc = tl.zeros([BT, BC], tl.float32)
        for k0 in range(0, R, BK):
            k = k0 + kk
            a = tl.load(a_ptr + t[:, None].to(tl.int64) * s_at + h * s_ah + k[None, :],
                        mask=tmask[:, None] & (k[None, :] < R), other=0.0)
            w = tl.load(wuv_ptr + h * s_wh + j[None, :] * s_wj + k[:, None],
                        mask=(k[:, None] < R) & jmask[None, :], other=0.0)
            acc = _dot(a, w, acc)
        tl.store(o_ptr + t[:, None].to(tl.int64) * s_ot + h * DV + j[None, :], acc.to(o_ptr.dtype.element_ty),
                 mask=tmask[:, None] & jmask[None, :])


def mla_absorb(q, kv, positions, cos, sin, w_uk, norm_weight, eps: float, q_scale: float):
    """q: [T, nh, dn + dr] (q_proj's output as heads; last dim contiguous); kv: [T, R + dr]
    (kv_a_proj's output: c_kv | k_rope, RoPE pairs interleaved in both); positions [T] int;
    cos, sin: [P, dr/2] float32; w_uk: [nh, dn, R] (kv_b_proj's key half, last dim contiguous);
    norm_weight: [R] -> (q [T, nh, R + dr] times q_scale, latent [T, 1, R + dr]), q's dtype."""
    dev = q.device
    check(q, "q", 3, FLOAT, dev)
    check(kv, "kv", 2, (q.dtype,), dev)
    check(w_uk, "w_uk", 3, (q.dtype,), dev)
    check(norm_weight, "norm_weight", 1, FLOAT, dev)
    T, nh, qd = q.shape
    _, dn, R = w_uk.shape
    dr = qd - dn
    if w_uk.shape[0] != nh or dr <= 0 or dr % 2 or tuple(kv.shape) != (T, R + dr) or norm_weight.shape[0] != R:
        fail(f"mla_absorb: q {tuple(q.shape)}, kv {tuple(kv.shape)}, w_uk {tuple(w_uk.shape)}, "
             f"norm_weight {tuple(norm_weight.shape)} disagree")
    check_rope_tables("mla_absorb", positions, cos, sin, dr, dev)
    if positions.shape[0] != T:
        fail(f"mla_absorb: positions {tuple(positions.shape)} must be [{T}]")
    if T > MAX_TOKENS:
        fail(f"mla_absorb: {T} tokens; at most {MAX_TOKENS} (larger batches: the batched GEMMs)")
    qo = torch.empty(T, nh, R + dr, dtype=q.dtype, device=dev)
    lat = torch.empty(T, 1, R + dr, dtype=q.dtype, device=dev)
    if T:
        mla_absorb_kernel[(nh + 1, triton.cdiv(R, _BC))](
            q, kv, positions, cos, sin, w_uk, norm_weight, qo, lat, T, float(eps), float(q_scale),
            q.stride(0), q.stride(1), kv.stride(0), cos.stride(0), w_uk.stride(0), w_uk.stride(1),
            qo.stride(0), qo.stride(1), lat.stride(0),
            DN=dn, R=R, HALF=dr // 2, NH=nh, BLOCK_R=triton.next_power_of_2(R),
            BLOCK_HALF=triton.next_power_of_2(dr // 2), BT=_BT, BC=_BC, BK=_BK, LT=4, num_warps=4)
    return qo, lat


def mla_unabsorb(out, w_uv):
    """out: [T, nh, >= R] (attention's output; its first R columns, last dim contiguous); w_uv:
    [nh, dv, R] (kv_b_proj's value half, last dim contiguous) -> o [T, nh * dv] in out's dtype,
    ``o[t, h * dv + j] = sum_r out[t, h, r] * w_uv[h, j, r]`` (float32 sums, rounded once)."""
    dev = out.device
    check(out, "out", 3, FLOAT, dev)
    check(w_uv, "w_uv", 3, (out.dtype,), dev)
    T, nh, width = out.shape
    _, dv, R = w_uv.shape
    if w_uv.shape[0] != nh or width < R:
        fail(f"mla_unabsorb: out {tuple(out.shape)} and w_uv {tuple(w_uv.shape)} disagree")
    if T > MAX_TOKENS:
        fail(f"mla_unabsorb: {T} tokens; at most {MAX_TOKENS} (larger batches: the batched GEMMs)")
    o = torch.empty(T, nh * dv, dtype=out.dtype, device=dev)
    if T:
        bc = min(_BC, max(16, triton.next_power_of_2(dv)))
        mla_unabsorb_kernel[(nh, triton.cdiv(dv, bc))](
            out, w_uv, o, T, out.stride(0), out.stride(1), w_uv.stride(0), w_uv.stride(1), o.stride(0),
            R=R, DV=dv, BT=_BT, BC=bc, BK=_BK, num_warps=8)
    return o
