"""Copying K/V rows of (token, KV head) pairs between pools, e.g. a host store and a device
hot set (attention/offload.py). Triton on CUDA (kernels/triton/host_gather.py: the kernel reads or
writes pinned host memory directly), or ``impl="triton"`` under the interpreter; else the PyTorch
reference :func:`copy_rows_ref`. Free of host syncs on the Triton path (CUDA-graph capturable).

fp8 pools (``--kv-cache-dtype fp8_*``): fp8 -> fp8 moves the bytes unchanged (a fetch into the hot
set, a prefix gather: the reader dequantizes them, as it reads the in-GPU pools); float -> fp8
quantizes with the layer's ``k_scale`` / ``v_scale`` ([1] float32), as the in-GPU stores do
(``reference.quantize_kv``); fp8 -> float is refused (gather in fp8, then ``reference.dequant_kv``).
"""

from __future__ import annotations

import torch

from .reference import is_fp8_kv, quantize_kv
from .triton.common import KV_FP8, check, fail

_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
_POOL = _FLOAT + KV_FP8
_INDEX = (torch.int32, torch.int64)


def copy_rows_ref(src_k, src_v, dst_k, dst_v, src_rows, dst_rows, heads, valid, k_scale=None, v_scale=None) -> None:
    """``dst[dst_rows[e], heads[e]] = src[src_rows[e], heads[e]]`` for K and V where ``valid[e]``.
    src_*: [S1, H, D]; dst_*: [S2, H, D] (any devices: the rows move to dst's); entries: [E] int;
    valid: [E] bool. Entries must not share a destination (the result would be unspecified).
    k_scale, v_scale: [1] float32, where dst is an fp8 pool and src is not (quantized on the way,
    see the module docstring)."""
    m = valid.to(torch.bool)
    dev = src_k.device
    s, h = src_rows.long()[m].to(dev), heads.long()[m].to(dev)
    t, ht = dst_rows.long()[m].to(dst_k.device), heads.long()[m].to(dst_k.device)
    for src, dst, scale in ((src_k, dst_k, k_scale), (src_v, dst_v, v_scale)):
        rows = src[s, h].to(dst.device)
        if is_fp8_kv(dst) and not is_fp8_kv(rows):
            rows = quantize_kv(rows, dst.dtype, scale.to(dst.device))
        dst[t, ht] = rows.to(dst.dtype)


def _mode(src_dtype, dst_dtype, k_scale, v_scale) -> int:
    """The host-gather kernel's MODE for a copy between pools of these dtypes (checked)."""
    from .triton.host_gather import COPY, QUANTIZE
    src8, dst8 = src_dtype in KV_FP8, dst_dtype in KV_FP8
    if src8 and src_dtype != dst_dtype:
        fail(f"copy_rows: an fp8 pool copies into one of its own format only, got {src_dtype} -> {dst_dtype} "
             "(gather the fp8 rows, then dequantize them: reference.dequant_kv)")
    if not dst8 or src8:
        return COPY
    if k_scale is None or v_scale is None:
        fail(f"copy_rows: {src_dtype} -> {dst_dtype} quantizes: it needs k_scale and v_scale ([1] float32)")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        check(t, name, 1, (torch.float32,))
    return QUANTIZE


def copy_rows(src_k, src_v, dst_k, dst_v, src_rows, dst_rows, heads, valid, impl: str = "auto",
              k_scale=None, v_scale=None) -> None:
    """See :func:`copy_rows_ref`. ``impl``: "auto" (Triton when dst or src is a CUDA tensor),
    "triton" or "torch". On the Triton path the entry tensors (and an fp8 copy's scales) live on
    the launching device and the pools are device tensors or pinned host tensors."""
    for name, t in (("src_k", src_k), ("src_v", src_v), ("dst_k", dst_k), ("dst_v", dst_v)):
        check(t, name, 3, _POOL)
    if src_v.dtype != src_k.dtype or dst_v.dtype != dst_k.dtype:
        fail(f"copy_rows: K and V pools differ in dtype: src {src_k.dtype}/{src_v.dtype}, "
             f"dst {dst_k.dtype}/{dst_v.dtype}")
    mode = _mode(src_k.dtype, dst_k.dtype, k_scale, v_scale)
    if src_k.shape != src_v.shape or dst_k.shape != dst_v.shape or src_k.shape[1:] != dst_k.shape[1:]:
        fail(f"copy_rows: pools disagree: src {tuple(src_k.shape)}/{tuple(src_v.shape)}, "
              f"dst {tuple(dst_k.shape)}/{tuple(dst_v.shape)}")
    n = src_rows.numel()
    for name, t in (("src_rows", src_rows), ("dst_rows", dst_rows), ("heads", heads)):
        check(t, name, None, _INDEX, last_contig=False)
        if t.numel() != n:
            fail(f"copy_rows: {name} has {t.numel()} entries, src_rows {n}")
    if valid.numel() != n:
        fail(f"copy_rows: valid has {valid.numel()} entries, src_rows {n}")
    use = impl == "triton" or (impl == "auto" and (dst_k.is_cuda or src_k.is_cuda))
    if impl not in ("auto", "triton", "torch"):
        fail(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    if not use:
        return copy_rows_ref(src_k, src_v, dst_k, dst_v, src_rows, dst_rows, heads, valid, k_scale, v_scale)
    from .triton.host_gather import copy_rows as _copy
    # contiguous: reshape(-1) of an expanded [1, H] entry tensor is a stride-0 view (no copy),
    # which the kernel would read past its one element (the illegal address at batch size 1)
    flat = lambda t: t.reshape(-1).contiguous()  # noqa: E731
    _copy(src_k, src_v, dst_k, dst_v, flat(src_rows), flat(dst_rows), flat(heads), flat(valid), mode=mode,
          k_scale=k_scale, v_scale=v_scale)


def token_rows(tiers):
    """``tiers`` (see :func:`copy_from_tiers`) with every pool viewed ``[S, 1, Hkv * D]``: a row is a
    token's values of every KV head, one contiguous piece (pools contiguous in their last two dims)."""
    def whole(t):
        return None if t is None else t.view(t.shape[0], 1, t.shape[1] * t.shape[2])
    hk, hv, dk, dv, n_dev = tiers
    return whole(hk), whole(hv), whole(dk), whole(dv), n_dev


def _by_tier(slots, valid, n_dev):
    """Entries split by the tier of their slot: (device rows, device mask, host rows, host mask)."""
    ok, on_dev = valid.to(torch.bool), slots <= n_dev
    return torch.where(on_dev, slots, 0), ok & on_dev, torch.where(on_dev, 0, slots - n_dev), ok & ~on_dev


def copy_from_tiers(tiers, dst_k, dst_v, slots, dst_rows, heads, valid, impl: str = "auto") -> None:
    """:func:`copy_rows` from a tiered store: ``tiers`` = (host k, host v, device k, device v,
    device_tokens) as ``engine.host_kv.HostKVStore.tiers`` gives them; ``slots`` are slot numbers,
    those up to ``device_tokens`` read from the device pools (at the slot), the others from the
    host tensors (at ``slot - device_tokens``). Without a device tier, one copy_rows call.
    An fp8 store's rows arrive in fp8 (dst of the store's dtype)."""
    hk, hv, dk, dv, n_dev = tiers
    if dk is None:
        return copy_rows(hk, hv, dst_k, dst_v, slots, dst_rows, heads, valid, impl)
    d_rows, d_ok, h_rows, h_ok = _by_tier(slots, valid, n_dev)
    copy_rows(dk, dv, dst_k, dst_v, d_rows, dst_rows, heads, d_ok, impl)
    copy_rows(hk, hv, dst_k, dst_v, h_rows, dst_rows, heads, h_ok, impl)


def copy_to_tiers(src_k, src_v, src_rows, tiers, slots, heads, valid, impl: str = "auto",
                  k_scale=None, v_scale=None) -> None:
    """:func:`copy_rows` into a tiered store (see :func:`copy_from_tiers`): entry e's row
    ``src_rows[e]`` goes to slot ``slots[e]`` of whichever tier holds that slot. k_scale,
    v_scale: an fp8 store's, where src is not fp8 (quantized on the way)."""
    hk, hv, dk, dv, n_dev = tiers
    sc = dict(k_scale=k_scale, v_scale=v_scale)
    if dk is None:
        return copy_rows(src_k, src_v, hk, hv, src_rows, slots, heads, valid, impl, **sc)
    d_rows, d_ok, h_rows, h_ok = _by_tier(slots, valid, n_dev)
    copy_rows(src_k, src_v, dk, dv, src_rows, d_rows, heads, d_ok, impl, **sc)
    copy_rows(src_k, src_v, hk, hv, src_rows, h_rows, heads, h_ok, impl, **sc)
