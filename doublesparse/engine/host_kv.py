"""The host tier of DS-Offload: K and V of every token slot in host memory.

Layout (per layer): ``k[layer], v[layer]`` : ``[num_slots, Hkv, D]`` in the K/V pools' dtype
(``--kv-cache-dtype``: the model's, or fp8 holding ``x / scale`` with the memory's per-layer
scales, half the bytes), on the host, page-locked when the engine runs on CUDA (device kernels read and write it through unified
addressing: kernels/triton/host_gather.py); on CPU a plain second buffer. Slot numbers are the
engine's (offload_memory.OffloadKVMemory), so the device label pool and this store are indexed alike.

Device tier (``device_tokens`` > 0): slots ``1 .. device_tokens`` keep their K/V in device pools
``device_k[layer], device_v[layer]`` : ``[device_tokens + 1, Hkv, D]`` (indexed by slot), the
others in the host tensors at row ``slot - device_tokens``. Requests the engine places there
(offload_memory.OffloadKVMemory.admit_row) decode like the offloaded ones, through the hot set, but their misses
are device copies; kernels/host_copy.py's tiered copies route each row by its slot.
"""

from __future__ import annotations

import math
import mmap
import weakref

import torch

GIB = 1 << 30
DEFAULT_HOST_GB = {"cuda": 64.0, "cpu": 1.0}
HUGE_PAGE = 2 << 20
# How the host store is page-locked (the GPU reads it in place, so the backing sets the GPU-side
# page size a random row read pays a translation for):
#   "register"        : pageable memory from torch, registered with cudaHostRegister
#   "register-thp"    : anonymous memory on 2 MiB boundaries advised as transparent huge pages,
#                       then registered (huge pages where the kernel grants them)
#   "cuda-host-alloc" : torch's pinned allocator (cudaHostAlloc; rounds each block up to a power of two)
PIN_MODES = ("register", "register-thp", "cuda-host-alloc")


class HostKVStore:
    """num_slots slots (slot 0: the padding slot, zero) of K and V for num_layers layers, the
    first ``device_tokens`` of them (after slot 0) in device pools on ``device``."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, pin: bool, device_tokens: int = 0, device=None,
                 pin_mode: str = "register"):
        if pin_mode not in PIN_MODES:
            raise ValueError(f"pin_mode must be one of {PIN_MODES}, got {pin_mode!r}")
        self.num_slots = int(num_slots)
        self.pinned = bool(pin)
        self.pin_mode = pin_mode
        self.device_tokens = int(device_tokens)
        dshape = (self.device_tokens + 1, num_kv_heads, head_dim)
        self.device_k = [torch.zeros(dshape, dtype=dtype, device=device) for _ in range(num_layers)] \
            if self.device_tokens else []
        self.device_v = [torch.zeros(dshape, dtype=dtype, device=device) for _ in range(num_layers)] \
            if self.device_tokens else []
        shape = (self.num_slots - self.device_tokens, num_kv_heads, head_dim)
        # empty, not zeros: a slot is written before any read; only the padding slot is read unwritten
        mode = pin_mode if pin else None
        self.k = [_host_empty(shape, dtype, mode) for _ in range(num_layers)]
        self.v = [_host_empty(shape, dtype, mode) for _ in range(num_layers)]
        if pin and pin_mode != "cuda-host-alloc":
            # unregistered with the store (the pools that use the tensors hold the store too)
            weakref.finalize(self, _unregister, [t.untyped_storage().data_ptr() for t in (*self.k, *self.v)])
        for t in (*self.k, *self.v):
            t[0].zero_()

    @property
    def nbytes(self) -> int:
        """Bytes in host memory."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def tiers(self, layer: int) -> tuple:
        """(host k, host v, device k, device v, device_tokens) of one layer, as the tiered copies
        of kernels/host_copy.py take them (the device pools None without a device tier)."""
        dk = self.device_k[layer] if self.device_tokens else None
        dv = self.device_v[layer] if self.device_tokens else None
        return self.k[layer], self.v[layer], dk, dv, self.device_tokens


def host_tokens(max_total_tokens: int | None, host_memory_gb: float | None, device_type: str,
                bytes_per_token: int) -> int:
    """Usable slots of the host store: ``max_total_tokens`` if given (it must fit the host bound
    when one is given), else as many as the bound holds (default bound: :data:`DEFAULT_HOST_GB`)."""
    gb = host_memory_gb if host_memory_gb is not None else DEFAULT_HOST_GB.get(device_type, 1.0)
    cap = int(gb * GIB) // bytes_per_token - 1
    if max_total_tokens:
        if host_memory_gb is not None and max_total_tokens > cap:
            raise ValueError(f"--max-total-tokens {max_total_tokens} needs "
                             f"{(max_total_tokens + 1) * bytes_per_token / GIB:.1f} GiB of host K/V, over "
                             f"--ds-offload-host-memory-gb {host_memory_gb}")
        return int(max_total_tokens)
    if cap < 1:
        raise ValueError(f"--ds-offload-host-memory-gb {gb} holds no token ({bytes_per_token} B each)")
    return cap


def _host_empty(shape, dtype, pin_mode: str | None) -> torch.Tensor:
    """A host tensor, page-locked as ``pin_mode`` says (:data:`PIN_MODES`; None: pageable). The
    default registers pageable memory with CUDA because torch's pinned allocator rounds every block
    up to a power of two, which would nearly double a store of a few GiB per layer."""
    if pin_mode == "cuda-host-alloc":
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    t = _thp_empty(shape, dtype) if pin_mode == "register-thp" else torch.empty(shape, dtype=dtype)
    if pin_mode is None or t.numel() == 0:
        return t
    cudart = torch.cuda.cudart()
    # the whole storage (a huge-page tensor starts inside its mapping): torch's is_pinned asks
    # about the storage's first byte
    st = t.untyped_storage()
    ptr, nbytes = st.data_ptr(), st.nbytes()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"could not page-lock {nbytes / GIB:.2f} GiB of host memory for the K/V store "
                           f"(cudaHostRegister error {int(err)}); lower --ds-offload-host-memory-gb")
    return t


def _thp_empty(shape, dtype) -> torch.Tensor:
    """An uninitialised host tensor on a 2 MiB boundary of an anonymous mapping advised as
    transparent huge pages (the tensor keeps the mapping alive)."""
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    off = (-raw.data_ptr()) % HUGE_PAGE
    return raw[off:off + n].view(dtype).view(shape)


def _unregister(ptrs: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for p in ptrs:
        cudart.cudaHostUnregister(p)
