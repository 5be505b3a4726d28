"""Copying K/V rows of (token, KV head) pairs between pools, e.g. a host store and a device
hot set (attention/offload.py). Triton on CUDA (kernels/triton/host_gather.py: the kernel reads or
writes pinned host memory directly), or ``impl="triton"`` under the interpreter; else the PyTorch
reference :func:`copy_rows_ref`. Free of host syncs on the Triton path (CUDA-graph capturable).
"""

from __future__ import annotations

import torch

from .triton.common import check, fail

_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
_INDEX = (torch.int32, torch.int64)


def copy_rows_ref(src_k, src_v, dst_k, dst_v, src_rows, dst_rows, heads, valid) -> None:
    """``dst[dst_rows[e], heads[e]] = src[src_rows[e], heads[e]]`` for K and V where ``valid[e]``.
    src_*: [S1, H, D]; dst_*: [S2, H, D] (any devices: the rows move to dst's); entries: [E] int;
    valid: [E] bool. Entries must not share a destination (the result would be unspecified)."""
    m = valid.to(torch.bool)
    dev = src_k.device
    s, h = src_rows.long()[m].to(dev), heads.long()[m].to(dev)
    t, ht = dst_rows.long()[m].to(dst_k.device), heads.long()[m].to(dst_k.device)
    dst_k[t, ht] = src_k[s, h].to(dst_k.device, dst_k.dtype)
    dst_v[t, ht] = src_v[s, h].to(dst_v.device, dst_v.dtype)


def copy_rows(src_k, src_v, dst_k, dst_v, src_rows, dst_rows, heads, valid, impl: str = "auto") -> None:
    """See :func:`copy_rows_ref`. ``impl``: "auto" (Triton when dst or src is a CUDA tensor),
    "triton" or "torch". On the Triton path the entry tensors live on the launching device and
    the pools are device tensors or pinned host tensors."""
    for name, t in (("src_k", src_k), ("src_v", src_v), ("dst_k", dst_k), ("dst_v", dst_v)):
        check(t, name, 3, _FLOAT)
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
        return copy_rows_ref(src_k, src_v, dst_k, dst_v, src_rows, dst_rows, heads, valid)
    from .triton.host_gather import copy_rows as _copy
    # contiguous: reshape(-1) of an expanded [1, H] entry tensor is a stride-0 view (no copy),
    # which the kernel would read past its one element (the illegal address at batch size 1)
    flat = lambda t: t.reshape(-1).contiguous()  # noqa: E731
    _copy(src_k, src_v, dst_k, dst_v, flat(src_rows), flat(dst_rows), flat(heads), flat(valid))


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
    host tensors (at ``slot - device_tokens``). Without a device tier, one copy_rows call."""
    hk, hv, dk, dv, n_dev = tiers
    if dk is None:
        return copy_rows(hk, hv, dst_k, dst_v, slots, dst_rows, heads, valid, impl)
    d_rows, d_ok, h_rows, h_ok = _by_tier(slots, valid, n_dev)
    copy_rows(dk, dv, dst_k, dst_v, d_rows, dst_rows, heads, d_ok, impl)
    copy_rows(hk, hv, dst_k, dst_v, h_rows, dst_rows, heads, h_ok, impl)


def copy_to_tiers(src_k, src_v, src_rows, tiers, slots, heads, valid, impl: str = "auto") -> None:
    """:func:`copy_rows` into a tiered store (see :func:`copy_from_tiers`): entry e's row
    ``src_rows[e]`` goes to slot ``slots[e]`` of whichever tier holds that slot."""
    hk, hv, dk, dv, n_dev = tiers
    if dk is None:
        return copy_rows(src_k, src_v, hk, hv, src_rows, slots, heads, valid, impl)
    d_rows, d_ok, h_rows, h_ok = _by_tier(slots, valid, n_dev)
    copy_rows(src_k, src_v, dk, dv, src_rows, d_rows, heads, d_ok, impl)
    copy_rows(src_k, src_v, hk, hv, src_rows, h_rows, heads, h_ok, impl)
