"""Shared by the Triton launchers (launch.py, ds_launch.py, fused_launch.py): argument checks (the
store's also run on the PyTorch path, so both paths refuse the same arguments) and device facts.

Every check reads only shapes, dtypes, strides and devices (never tensor values), so the launchers
stay capturable in CUDA graphs.
"""

from __future__ import annotations

import functools
import os

import torch

from ..tuning import KernelTuning
from ..workspace import DecodeWorkspace
from .pdl import HAVE_GDC

FLOAT = (torch.bfloat16, torch.float16, torch.float32)
_LABEL = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
KV_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # an fp8 K/V pool (values / its per-layer scale)
_KV = FLOAT + KV_FP8
INDEX = (torch.int32, torch.int64)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def fail(msg: str):
    raise ValueError(msg)


def check(t, name, ndim=None, dtypes=None, device=None, last_contig=True):
    if not isinstance(t, torch.Tensor):
        fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        fail(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        fail(f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}")
    if device is not None and t.device != device:
        fail(f"{name} is on {t.device}, expected {device}")
    if last_contig and t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        fail(f"{name} must be contiguous in its last dim (stride {t.stride()})")


def check_rope_tables(who: str, positions, cos, sin, width: int, dev) -> None:
    """RoPE's inputs beside the rotated tensors: positions [T] int, cos / sin [max_pos, width / 2]
    float32 for a rotated width ``width`` (even), on ``dev``."""
    check(positions, "positions", 1, INDEX, dev)
    check(cos, "cos", 2, (torch.float32,), dev)
    check(sin, "sin", 2, (torch.float32,), dev)
    if width % 2 or cos.shape[1] != width // 2 or sin.shape != cos.shape:
        fail(f"{who}: cos/sin must be [max_pos, {width // 2}], got {tuple(cos.shape)} / {tuple(sin.shape)}")


def check_caches(k_cache, v_cache, dev, k_scale=None, v_scale=None):
    check(k_cache, "k_cache", 3, _KV, dev)
    check(v_cache, "v_cache", 3, (k_cache.dtype,), dev)
    if v_cache.shape != k_cache.shape:
        fail(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if k_cache.dtype in KV_FP8:
        if k_scale is None or v_scale is None:
            fail(f"a {k_cache.dtype} K/V pool needs k_scale and v_scale ([1] float32)")
        check(k_scale, "k_scale", 1, (torch.float32,), dev)
        check(v_scale, "v_scale", 1, (torch.float32,), dev)


def kv_scale_args(k_cache, k_scale, v_scale):
    """The kernels' (k_scale, v_scale, KV_FP8) arguments: the scales of an fp8 pool, else any
    pointer (the kernels read them only under KV_FP8)."""
    if k_cache.dtype in KV_FP8:
        return k_scale, v_scale, True
    return k_cache, k_cache, False


def check_labels(label_cache, label_scale, channels, k_cache, dev):
    S, Hkv, D = k_cache.shape
    check(label_cache, "label_cache", 3, _LABEL, dev)
    if label_cache.shape[:2] != (S, Hkv):
        fail(f"label_cache must be [{S}, {Hkv}, r], got {tuple(label_cache.shape)}")
    r = label_cache.shape[2]
    if not 1 <= r <= D:
        fail(f"heavy channel count r={r} must be in [1, head_dim={D}]")
    check(channels, "channels", 2, INDEX, dev)
    if tuple(channels.shape) != (Hkv, r):
        fail(f"channels must be [{Hkv}, {r}] (Hkv, r), got {tuple(channels.shape)}")
    if label_cache.dtype == torch.float8_e4m3fn:
        if label_scale is None:
            fail("fp8 labels need label_scale ([1] float32)")
        check(label_scale, "label_scale", 1, (torch.float32,), dev)
    return r


def check_store_args(k_cache, v_cache, k, v, slots, label_cache, label_scale, channels, k_scale=None,
                     v_scale=None, k_label=None):
    """The store's arguments (ops.store_kv, ops.rope_store), on either path."""
    dev = k.device
    check_caches(k_cache, v_cache, dev, k_scale, v_scale)
    check(k, "k", 3, FLOAT, dev)
    check(v, "v", 3, FLOAT, dev)
    N, Hkv, D = k.shape
    if tuple(v.shape) != (N, Hkv, D):
        fail(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    if tuple(k_cache.shape[1:]) != (Hkv, D):
        fail(f"k is [N, {Hkv}, {D}] but k_cache is {tuple(k_cache.shape)}")
    check(slots, "slots", 1, INDEX, dev)
    if slots.shape[0] != N:
        fail(f"slots has {slots.shape[0]} entries for {N} tokens")
    if label_cache is not None:
        check_labels(label_cache, label_scale, channels, k_cache, dev)
    if k_label is not None:
        check(k_label, "k_label", 3, FLOAT, dev)
        if tuple(k_label.shape) != (N, Hkv, D):
            fail(f"k_label shape {tuple(k_label.shape)} != k shape {tuple(k.shape)}")


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: few programs keep CPU tests fast


def check_q_label(q_label, q):
    """The query a Double Sparsity score reads beside the attention's q (ops.ds_decode):
    q's shape, dtype and device, last dim contiguous. Returns it."""
    check(q_label, "q_label", 3, (q.dtype,), q.device)
    if q_label.shape != q.shape:
        fail(f"q_label shape {tuple(q_label.shape)} != q shape {tuple(q.shape)}")
    return q_label


def check_decode(q, k_cache, v_cache, req_to_token, req_idx, seq_lens, ws, out, k_scale=None, v_scale=None):
    dev = q.device
    check(q, "q", 3, FLOAT, dev)
    check_caches(k_cache, v_cache, dev, k_scale, v_scale)
    B, Hq, D = q.shape
    S, Hkv, Dk = k_cache.shape
    if Dk != D:
        fail(f"q head_dim {D} != cache head_dim {Dk}")
    if Hq % Hkv:
        fail(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    check(req_to_token, "req_to_token", 2, (torch.int32,), dev)
    check(req_idx, "req_idx", 1, INDEX, dev)
    check(seq_lens, "seq_lens", 1, (torch.int32,), dev)
    if req_idx.shape[0] != B or seq_lens.shape[0] != B:
        fail(f"req_idx {tuple(req_idx.shape)} and seq_lens {tuple(seq_lens.shape)} must be [{B}]")
    if not isinstance(ws, DecodeWorkspace):
        fail("ws must be a DecodeWorkspace (allocate one at the largest batch/context)")
    if (ws.num_q_heads, ws.num_kv_heads, ws.head_dim) != (Hq, Hkv, D):
        fail(f"workspace is for heads {ws.num_q_heads}/{ws.num_kv_heads} d{ws.head_dim}, "
              f"got {Hq}/{Hkv} d{D}")
    if B > ws.max_batch:
        fail(f"batch {B} exceeds workspace max_batch {ws.max_batch}")
    if ws.part_o.device != dev:
        fail(f"workspace is on {ws.part_o.device}, q on {dev}")
    if out is not None:
        check(out, "out", 3, (q.dtype,), dev)
        if out.shape != q.shape:
            fail(f"out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
    return B, Hq, Hkv, D


@functools.lru_cache(maxsize=None)
def _pdl_capable(device: torch.device) -> bool:
    # NVIDIA only: ROCm also reports device type "cuda" (and MI300 a "capability" of 9.4)
    return (device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9)


def pdl_enabled(device: torch.device, tuning: KernelTuning) -> bool:
    """Whether programmatic dependent launch (pdl.py) is used on ``device``."""
    return tuning.pdl and HAVE_GDC and not INTERPRET and _pdl_capable(device)


def pdl_kwargs(device: torch.device, tuning: KernelTuning) -> dict:
    """Launch kwargs of a kernel that takes part in programmatic dependent launch (pdl.py)."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device, tuning) else {}
