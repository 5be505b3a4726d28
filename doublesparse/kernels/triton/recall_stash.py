"""Triton kernel: keep one layer's decode inputs and outputs of a few batch rows for the sampled
attention recall (attention/recall.py).

It does nothing unless the device control word names this layer; the host arms that word (an
async copy) on sampled steps only. Eagerly it is launched on sampled steps at the sampled layer
only; in the CUDA graph of a sampled step (the runner keeps one per sparse bucket, beside the
graph without it that every other step replays) after every layer, and the word picks the layer at
replay, so the graph needs no host decision and no host sync.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def recall_stash_kernel(
    ctl_ptr,                                   # [1 + N] int32: armed layer (-1: none), batch rows (-1: none)
    q_ptr, o_ptr,                              # [B, Hq, D] the layer's query and sparse output
    sel_ptr, rowk_ptr,                         # [B, Hq, K] int32 selected slots; [B, Hq] int32 kept counts
    dq_ptr, do_ptr, dsel_ptr, drowk_ptr,       # [N, Hq, D] f32 x2; [N, Hq, K] int32; [N, Hq] int32
    layer, K, R,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_sb, stride_sh, stride_rb,
    HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_ROWK: tl.constexpr,
):
    # One program: one stashed row i, one query head h (and selection row h when h < R).
    i = tl.program_id(0)
    h = tl.program_id(1)
    armed = tl.load(ctl_ptr)
    b = tl.load(ctl_ptr + 1 + i)
    if (armed == layer) & (b >= 0):
        b64 = b.to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        x = tl.load(q_ptr + b64 * stride_qb + h * stride_qh + d, mask=dm).to(tl.float32)
        tl.store(dq_ptr + (i * HQ + h) * D + d, x, mask=dm)
        y = tl.load(o_ptr + b64 * stride_ob + h * stride_oh + d, mask=dm).to(tl.float32)
        tl.store(do_ptr + (i * HQ + h) * D + d, y, mask=dm)
        if h < R:
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                km = kk < K
                s = tl.load(sel_ptr + b64 * stride_sb + h * stride_sh + kk, mask=km)
                tl.store(dsel_ptr + (i * HQ + h).to(tl.int64) * K + kk, s, mask=km)
            if HAS_ROWK:
                tl.store(drowk_ptr + i * HQ + h, tl.load(rowk_ptr + b64 * stride_rb + h))


def recall_stash(ctl, q, out, sel, row_k, dq, do, dsel, drowk, layer: int, R: int) -> None:
    """Launch the stash (see the module docstring). ctl: [1 + N] int32; q, out: [B, Hq, D] (last
    dim contiguous); sel: [B', Hq, K] int32 with B' >= B (the workspace's selected slots); row_k:
    [B', Hq] int32 or None (top-p's kept counts); dq, do: [N, Hq, D] float32; dsel: [N, Hq, K]
    int32; drowk: [N, Hq] int32; R: the selection rows (Hq per head, else Hkv)."""
    N, Hq, D = dq.shape
    K = dsel.shape[2]
    if sel.shape[2] != K or q.shape[1:] != (Hq, D) or out.shape[1:] != (Hq, D):
        raise ValueError(f"recall_stash: shapes q {tuple(q.shape)}, out {tuple(out.shape)}, sel "
                         f"{tuple(sel.shape)} do not match the stash {tuple(dq.shape)}, K={K}")
    if q.stride(2) != 1 or out.stride(2) != 1 or sel.stride(2) != 1:
        raise ValueError("recall_stash: q, out and sel need a contiguous last dimension")
    has_rowk = row_k is not None
    rk = row_k if has_rowk else sel
    recall_stash_kernel[(N, Hq)](
        ctl, q, out, sel, rk, dq, do, dsel, drowk, int(layer), int(K), int(R),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), sel.stride(0), sel.stride(1),
        rk.stride(0),
        HQ=Hq, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_K=min(1024, triton.next_power_of_2(K)),
        HAS_ROWK=has_rowk, num_warps=4,
    )


__all__ = ["recall_stash", "recall_stash_kernel"]
