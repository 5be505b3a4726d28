"""DS-Offload's memory tier: the engine's pools with K/V in a host store (engine/host_kv.py).

Built by engine/offload_setup.py's ``build_offload`` in place of :class:`~.memory.KVMemory`, as
tensor parallelism builds its own memory (distributed/rank.py), so the in-GPU path stays free
of offload cases. What changes against the in-GPU memory:

    k[layer], v[layer] : the host store's ``[num_slots - device_tokens, Hkv, D]`` tensors, in
                         ``plan.kv_dtype`` (--kv-cache-dtype; fp8 with ``k_scale`` / ``v_scale``
                         on the device, as in-GPU), on the host (page-locked on CUDA); no K/V
                         pool on the device
    label, label_scale, req_to_token : on the device, as in-GPU (memory.py's layout)
    device tier        : slots ``1 .. device_tokens`` keep K/V in the store's device pools
                         (``device_k/v[layer]`` : ``[device_tokens + 1, Hkv, D]``)
    row_on_device      : ``[max_reqs + 1]`` bool, host: rows whose new tokens go to the tier
    promised           : ``[max_reqs + 1]`` int64, host: tier slots each such row may still take
    row_release_hooks  : called with a row before its slots are freed (the hot set forgets it)

Admission counts the host store's slots only (``slots.admission_size``): every request fits
there, so the device tier, on top, never makes a reservation fail.
"""

from __future__ import annotations

import torch

from .memory import KVMemory, MemoryPlan, SlotAllocator


class TieredSlotAllocator(SlotAllocator):
    """Slots 1..n, of which 1..``device_tier`` form a second free list (DS-Offload's device tier),
    allocated with ``alloc(n, on_device=True)``; the others (the host store's) by default."""

    def __init__(self, num_usable: int, device_tier: int = 0):
        super().__init__(num_usable)
        self.device_tier = int(device_tier)
        # the tier's slots come first, the host store's after them (host_kv.py's layout)
        self.free_slots = torch.arange(self.device_tier + 1, num_usable + 1, dtype=torch.int64)
        self.free_device = torch.arange(1, self.device_tier + 1, dtype=torch.int64)

    @property
    def num_free(self) -> int:
        return int(self.free_slots.numel()) + int(self.free_device.numel())

    @property
    def num_free_device(self) -> int:
        return int(self.free_device.numel())

    @property
    def admission_size(self) -> int:
        """Slots outside the device tier: what admission may promise (every request fits there)."""
        return self.size - self.device_tier

    @property
    def admission_free(self) -> int:
        """Free slots outside the device tier."""
        return int(self.free_slots.numel())

    def alloc(self, n: int, on_device: bool = False) -> torch.Tensor:
        """``[n]`` int64 host tensor of distinct free slots (of the device tier when
        ``on_device``); OutOfSlots if fewer are free."""
        if not on_device:
            return super().alloc(n)
        out, self.free_device = self._take(self.free_device, n, "device-tier ")
        return out

    def _give_back(self, slots: torch.Tensor) -> None:
        dev = slots <= self.device_tier
        if bool(dev.any()):
            self.free_device = torch.cat([self.free_device, slots[dev]])
            slots = slots[~dev]
        super()._give_back(slots)


class OffloadKVMemory(KVMemory):
    """KVMemory whose K/V live in ``store`` (a :class:`~.host_kv.HostKVStore` with ``num_slots``
    slots, the first ``store.device_tokens`` after slot 0 in its device tier)."""

    def __init__(self, plan: MemoryPlan, device: torch.device | str, store):
        self.kv_store = store   # before the base constructor: its factories read it
        super().__init__(plan, device)
        self.row_release_hooks: list = []
        rows = plan.max_reqs + 1
        # which rows keep their new tokens in the device tier, and how many tier slots each may
        # still take (promised at admission, so allocation never fails)
        self.row_on_device = torch.zeros(rows, dtype=torch.bool)
        self.promised = torch.zeros(rows, dtype=torch.int64)

    def _make_kv(self) -> tuple[list, list]:
        return self.kv_store.k, self.kv_store.v

    def _make_slots(self) -> TieredSlotAllocator:
        return TieredSlotAllocator(self.plan.max_total_tokens, device_tier=self.kv_store.device_tokens)

    @property
    def device_tier_pools(self) -> list:
        """The device tier's K/V pools (``[device_tokens + 1, Hkv, D]`` each; none without a tier)."""
        return [*self.kv_store.device_k, *self.kv_store.device_v]

    def tiers(self, layer: int) -> tuple:
        """Where layer ``layer``'s K/V live, as kernels/host_copy.py's tiered copies take them:
        (host k, host v, device k, device v, device_tokens) (HostKVStore.tiers)."""
        return self.kv_store.tiers(layer)

    # ------------------------------------------------------------------- request-row hooks
    def admit_row(self, row: int, tokens: int) -> bool:
        """Put request row ``row``, which will allocate up to ``tokens`` new slots, in the device
        tier if the tier's free slots not promised to other rows hold them; returns whether it
        did (always False without a device tier)."""
        if not self.slots.device_tier or self.slots.num_free_device - int(self.promised.sum()) < tokens:
            return False
        self.row_on_device[row] = True
        self.promised[row] = int(tokens)
        return True

    def caches_row(self, row: int) -> bool:
        """A device-tier row caches none of its tokens: the tier's slots go back to the tier when
        it ends, so that cached prefixes, which only eviction frees, never fill the tier."""
        return not bool(self.row_on_device[row])

    def _forget_row(self, row: int) -> None:
        for hook in self.row_release_hooks:
            hook(row)
        self.promised[row] = 0
        self.row_on_device[row] = False

    def _alloc(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        if not self.slots.device_tier:
            return self.slots.alloc(n)
        dev = self.row_on_device[rows]
        slots = torch.empty(n, dtype=torch.int64)
        nd = int(dev.sum())
        if nd < n:  # first: the host store is the one that could run short (then nothing is taken)
            slots[~dev] = self.slots.alloc(n - nd)
        if nd:
            slots[dev] = self.slots.alloc(nd, on_device=True)
            self.promised.index_add_(0, rows[dev], torch.full((nd,), -1, dtype=torch.int64)).clamp_(min=0)
        return slots

    def _device_kv(self) -> list:
        # the host store's K/V are not device bytes; its device tier is
        return self.device_tier_pools
