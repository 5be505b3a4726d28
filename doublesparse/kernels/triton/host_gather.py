"""Triton kernel: copy K and V rows of chosen (token, KV head) pairs between two pools.

The offloaded decode uses it both ways: host store -> device hot set (the misses of a step's
selection) and new tokens' rows -> host store. Either pool may be pinned host memory: CUDA's
unified addressing lets a kernel load from and store to page-locked host memory through the same
pointers (the launcher accepts pinned tensors since they are accessible from the device), so a
gather of scattered 256-byte rows costs one launch, no staging copy and no host sync.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def copy_rows_kernel(
    src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr,   # pools: [S_src, H, D], [S_dst, H, D]
    src_row_ptr, dst_row_ptr, head_ptr, valid_ptr,  # entries: [E] each (valid: int8 0/1)
    E,
    stride_sks, stride_skh, stride_svs, stride_svh,
    stride_dks, stride_dkh, stride_dvs, stride_dvh,
    D: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
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


def copy_rows(src_k, src_v, dst_k, dst_v, src_rows, dst_rows, heads, valid, block_e: int | None = None):
    """Launch over ``E`` entries (flat int tensors on the launching device; ``valid`` bool or
    int8). No checks beyond shapes here: kernels/host_copy.py checks. ``block_e``: entries per
    program (default: :data:`ELEMS_PER_PROGRAM` values' worth, 2 to :data:`MAX_ENTRIES`)."""
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
    copy_rows_kernel[(triton.cdiv(E, block_e),)](
        src_k, src_v, dst_k, dst_v, src_rows, dst_rows, heads, valid, E,
        src_k.stride(0), src_k.stride(1), src_v.stride(0), src_v.stride(1),
        dst_k.stride(0), dst_k.stride(1), dst_v.stride(0), dst_v.stride(1),
        D=D, BLOCK_E=block_e, BLOCK_D=BD, num_warps=4,
    )
