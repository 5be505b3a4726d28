"""Triton kernel: copy K and V rows of chosen (token, KV head) pairs between two pools.

The offloaded decode uses it both ways: host store -> device hot set (the misses of a step's
selection) and new tokens' rows -> host store. Either pool may be pinned host memory: CUDA's
unified addressing lets a kernel load from and store to page-locked host memory through the same
pointers (the launcher accepts pinned tensors since they are accessible from the device), so a
gather of scattered 256-byte rows costs one launch, no staging copy and no host sync.

fp8 K/V (``--kv-cache-dtype fp8_*``): a copy between two fp8 pools moves the bytes as they are
(half of bf16's over PCIe); one from a float tensor into an fp8 pool quantizes on the way
(``x / scale`` clamped, rounded to nearest even: the store kernels' arithmetic, kv_quant.py). Rows
for a float reader are gathered in fp8 and dequantized by the reader, as from the in-GPU pools.
"""

import torch
import triton
import triton.language as tl

from .common import INTERPRET
from .kv_quant import fp8_constexprs, quantize

# MODE: how values change on the way (see the module docstring)
COPY, QUANTIZE = 0, 1


@triton.jit
def copy_rows_kernel(
    src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr,   # pools: [S_src, H, D], [S_dst, H, D]
    src_row_ptr, dst_row_ptr, head_ptr, valid_ptr,  # entries: [E] each (valid: int8 0/1)
    k_scale_ptr, v_scale_ptr,                     # [1] float32 each (QUANTIZE)
    E,
    stride_sks, stride_skh, stride_svs, stride_svh,
    stride_dks, stride_dkh, stride_dvs, stride_dvh,
    D: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, MODE: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
):
    # One program: BLOCK_E entries; an entry copies the D values of K and of V of one
    # (row, head) pair. Invalid entries load and store nothing (no bytes cross PCIe for them).
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = e < E
    ok = tl.load(valid_ptr + e, mask=emask, other=0) != 0
    emask = emask & ok
    s = tl.load(src_row_ptr + e, mask=emask, other=0).to(tl.int64)
    t = tl.load(dst_row_ptr + e, mask=emask, other=0).to(tl.int64)
    h = tl.load(head_ptr + e, mask=emask, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m2 = emask[:, None] & (d[None, :] < D)
    k = tl.load(src_k_ptr + s[:, None] * stride_sks + h[:, None] * stride_skh + d[None, :], mask=m2)
    v = tl.load(src_v_ptr + s[:, None] * stride_svs + h[:, None] * stride_svh + d[None, :], mask=m2)
    if MODE == 1:  # QUANTIZE
        kd = dst_k_ptr.dtype.element_ty
        k = quantize(k, tl.load(k_scale_ptr), kd, FP8_MAX, FP8_MANT, FP8_BIAS, INTERPRET)
        v = quantize(v, tl.load(v_scale_ptr), kd, FP8_MAX, FP8_MANT, FP8_BIAS, INTERPRET)
    tl.store(dst_k_ptr + t[:, None] * stride_dks + h[:, None] * stride_dkh + d[None, :],
             k.to(dst_k_ptr.dtype.element_ty), mask=m2)
    tl.store(dst_v_ptr + t[:, None] * stride_dvs + h[:, None] * stride_dvh + d[None, :],
             v.to(dst_v_ptr.dtype.element_ty), mask=m2)


# Values of K (and as many of V) one program moves, and at most this many entries: each lane
# holds a pointer per value, so 32 entries of 576-wide rows (MLA-sized) need 254 registers and
# spill 504 bytes on sm_90, while 32 entries of 64 or 128 values (the shapes the GPU tests ran)
# take 32 / 64 registers (`python benchmarks/kernel_resources.py --families`). Not timed on a GPU.
ELEMS_PER_PROGRAM = 4096
MAX_ENTRIES = 32


def copy_rows(src_k, src_v, dst_k, dst_v, src_rows, dst_rows, heads, valid, block_e: int | None = None,
              mode: int = COPY, k_scale=None, v_scale=None):
    """Launch over ``E`` entries (flat int tensors on the launching device; ``valid`` bool or
    int8). No checks beyond shapes here: kernels/host_copy.py checks. ``block_e``: entries per
    program (default: :data:`ELEMS_PER_PROGRAM` values' worth, 2 to :data:`MAX_ENTRIES`).
    ``mode``: :data:`COPY` or :data:`QUANTIZE` (dst fp8, src not), with the pool's ``k_scale`` /
    ``v_scale`` ([1] float32 on the launching device)."""
    E = src_rows.numel()
    if E == 0:
        return
    for name, t in (("src_rows", src_rows), ("dst_rows", dst_rows), ("heads", heads), ("valid", valid)):
        if t.dim() != 1 or t.numel() != E or (E > 1 and t.stride(0) != 1):
            raise ValueError(f"copy_rows: {name} must be a contiguous [{E}] tensor, got shape "
                             f"{tuple(t.shape)} stride {t.stride()}")
    D = src_k.shape[2]
    BD = triton.next_power_of_2(D)
    block_e = block_e or min(MAX_ENTRIES, max(2, ELEMS_PER_PROGRAM // BD))
    valid = valid.view(torch.int8) if valid.dtype == torch.bool else valid
    fp8 = fp8_constexprs(dst_k.dtype)
    del fp8["KV_FP8"]
    ks, vs = (k_scale, v_scale) if mode == QUANTIZE else (valid, valid)   # unread under COPY
    copy_rows_kernel[(triton.cdiv(E, block_e),)](
        src_k, src_v, dst_k, dst_v, src_rows, dst_rows, heads, valid, ks, vs, E,
        src_k.stride(0), src_k.stride(1), src_v.stride(0), src_v.stride(1),
        dst_k.stride(0), dst_k.stride(1), dst_v.stride(0), dst_v.stride(1),
        D=D, BLOCK_E=block_e, BLOCK_D=BD, MODE=mode, **fp8, INTERPRET=INTERPRET, num_warps=4,
    )
