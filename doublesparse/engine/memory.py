"""KV / label pools, the token-slot allocator and the request -> token table.

Layout (per layer, see doublesparse/kernels/reference.py):
    k[layer], v[layer] : [num_slots, Hkv, D]   --kv-cache-dtype (auto: the model dtype); fp8 pools
                                               store x / scale
    k_scale[layer], v_scale[layer] : [1] float32  the fp8 pools' dequant scales (engine/kv_scales.py)
    label[layer]       : [num_slots, Hkv, r]   bf16, or float8_e4m3fn storing k[channels] / scale
    label_scale[layer] : [1] float32           fp8 dequant scale (1.0 for bf16)
    req_to_token       : [max_reqs, max_ctx] int32   position -> slot, on the device
Slot 0 is the padding slot (never handed out: padded decode rows write there) and row 0 of
req_to_token is the padding row (all zeros), so a padded batch entry reads only slot 0.

Allocators keep their bookkeeping on the host as tensors (no per-token Python loops): the
scheduler needs the counts on the host anyway, and freeing reads a host mirror of req_to_token
instead of syncing with the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..config import CPU_DEFAULT_TOTAL_TOKENS, EngineConfig
from ..kernels.transfer import to_device

CPU_POOL_BYTES = 1 << 30
LABEL_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
KV_CACHE_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(cfg: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The K/V pools' dtype: ``--kv-cache-dtype``, "auto" = the model's."""
    return KV_CACHE_TORCH_DTYPES.get(cfg.kv_cache_dtype, model_dtype)


class OutOfSlots(RuntimeError):
    pass


@dataclass(frozen=True)
class MemoryPlan:
    """Runtime sizing facts (not configuration): what the pools hold and what they cost."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    heavy_channel_num: int          # 0: no label pool
    kv_dtype: torch.dtype           # the K/V pools' (--kv-cache-dtype), which sizes them
    label_dtype: torch.dtype | None
    max_total_tokens: int           # usable slots (the padding slot comes on top)
    max_reqs: int                   # usable rows (the padding row comes on top)
    max_ctx: int
    latent: bool = False            # MLA: one latent row per token, the V pool is the K pool

    @property
    def num_slots(self) -> int:
        return self.max_total_tokens + 1

    @property
    def kv_bytes_per_token(self) -> int:
        kv = 1 if self.latent else 2
        return kv * self.num_layers * self.num_kv_heads * self.head_dim * _esize(self.kv_dtype)

    @property
    def label_bytes_per_token(self) -> int:
        if not self.heavy_channel_num:
            return 0
        return self.num_layers * self.num_kv_heads * self.heavy_channel_num * _esize(self.label_dtype)

    @property
    def bytes_per_token(self) -> int:
        return self.kv_bytes_per_token + self.label_bytes_per_token

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.bytes_per_token + (self.max_reqs + 1) * self.max_ctx * 4

    def describe(self) -> str:
        lab = (f", labels r={self.heavy_channel_num} {self.label_dtype}" if self.heavy_channel_num else "")
        return (f"KV pool: {self.max_total_tokens} tokens x {self.bytes_per_token} B "
                f"= {self.total_bytes / 2**20:.1f} MiB (KV {dtype_name(self.kv_dtype)}{lab}), "
                f"{self.max_reqs} request rows x {self.max_ctx} ctx")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float8_e4m3fn`` -> ``float8_e4m3fn`` (as /health and the startup line show it)."""
    return str(dtype).removeprefix("torch.")


def _esize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def prefill_reserve_bytes(cfg: EngineConfig, model_config, kv_dtype: torch.dtype, max_ctx: int) -> int:
    """Transient memory one prefill chunk needs beyond the pools: the chunk's activations
    (residual, norms, qkv, gate_up and its product, in the model dtype) and the K/V of the longest
    context repeated over the query group for SDPA's flash path (attention/base.py)."""
    e = _esize(kv_dtype)
    mc = model_config
    per_token = (4 * mc.hidden_size + (mc.num_q_heads + 2 * mc.num_kv_heads) * mc.head_dim
                 + 3 * getattr(mc, "intermediate_size", 4 * mc.hidden_size)) * e
    attn = 2 * mc.num_q_heads * max_ctx * mc.head_dim * e
    return cfg.chunked_prefill_size * per_token + attn


def plan_memory(cfg: EngineConfig, model_config, kv_dtype: torch.dtype, device: torch.device,
                max_ctx: int, heavy_channel_num: int, reserved_bytes: int = 0) -> MemoryPlan:
    """Size the pools (``kv_dtype``: the model's; the pools take ``--kv-cache-dtype``, so an fp8
    cache holds twice the tokens of a bf16 one in the same bytes): ``--max-total-tokens`` if given; else on CUDA the part of
    ``mem_fraction_static * total`` memory not in use yet (weights are already loaded) minus
    ``reserved_bytes`` (workspace) and one prefill chunk's transient memory; on CPU :data:`CPU_DEFAULT_TOTAL_TOKENS` capped at
    :data:`CPU_POOL_BYTES`."""
    k_bias = bool(getattr(model_config, "attention_bias", False))
    label_dtype = LABEL_TORCH_DTYPES[cfg.label_dtype_for(device, k_bias)] if heavy_channel_num else None
    max_reqs = cfg.resolved_max_running_requests
    latent = getattr(model_config, "mla", None) is not None
    if latent and cfg.kv_cache_fp8:
        raise ValueError(f"kv_cache_dtype={cfg.kv_cache_dtype!r}: the MLA latent pool of "
                         f"{getattr(model_config, 'name', 'this model')} is kept in the model's dtype; "
                         "use --kv-cache-dtype auto")
    probe = MemoryPlan(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim,
                       heavy_channel_num, kv_cache_dtype(cfg, kv_dtype), label_dtype, 1, max_reqs, max_ctx,
                       latent=latent)
    if cfg.max_total_tokens:
        tokens = cfg.max_total_tokens
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - total * (1.0 - cfg.mem_fraction_static) - reserved_bytes
        budget -= prefill_reserve_bytes(cfg, model_config, kv_dtype, max_ctx)
        budget -= (max_reqs + 1) * max_ctx * 4
        tokens = int(budget // probe.bytes_per_token)
        if tokens < max_ctx:
            raise RuntimeError(f"only {max(tokens, 0)} KV tokens fit in mem_fraction_static="
                               f"{cfg.mem_fraction_static} of GPU memory (need >= {max_ctx}); "
                               "raise --mem-fraction-static or set --max-total-tokens")
    else:
        # fixed default, but no more than ~1 GiB of host memory (at least one full context)
        tokens = min(CPU_DEFAULT_TOTAL_TOKENS, max(max_ctx, CPU_POOL_BYTES // probe.bytes_per_token))
    return dataclasses.replace(probe, max_total_tokens=int(tokens))


class SlotAllocator:
    """Free list of token slots 1..n as a host int64 tensor; ``in_use`` catches double frees.

    A subclass with a second free list (engine/offload_memory.py) routes freed slots through the
    :meth:`_give_back` hook and narrows the ``admission_*`` counts."""

    def __init__(self, num_usable: int):
        self.size = num_usable
        self.free_slots = torch.arange(1, num_usable + 1, dtype=torch.int64)
        self.in_use = torch.zeros(num_usable + 1, dtype=torch.bool)
        self.in_use[0] = True  # padding slot: never allocatable, never freeable

    @property
    def num_free(self) -> int:
        return int(self.free_slots.numel())

    @property
    def num_used(self) -> int:
        return self.size - self.num_free

    @property
    def admission_size(self) -> int:
        """Slots the scheduler's admission may promise to requests: all of them here."""
        return self.size

    @property
    def admission_free(self) -> int:
        """Free slots among those :attr:`admission_size` counts."""
        return self.num_free

    def alloc(self, n: int) -> torch.Tensor:
        """``[n]`` int64 host tensor of distinct free slots; OutOfSlots if fewer are free."""
        out, self.free_slots = self._take(self.free_slots, n, "")
        return out

    def _take(self, pool: torch.Tensor, n: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the first ``n`` slots of free list ``pool``, marked in use; the rest of the list)."""
        if n > pool.numel():
            raise OutOfSlots(f"asked for {n} {what}KV slots, {pool.numel()} of {self.size} free")
        out = pool[:n]
        self.in_use[out] = True
        return out, pool[n:]

    def free(self, slots: torch.Tensor) -> None:
        slots = slots.to(torch.int64).flatten().cpu()
        if slots.numel() == 0:
            return
        if not bool(self.in_use[slots].all()) or bool((slots == 0).any()):
            raise ValueError("freeing KV slots that are not allocated (double free?)")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("freeing the same KV slot twice in one call")
        self.in_use[slots] = False
        self._give_back(slots)

    def _give_back(self, slots: torch.Tensor) -> None:
        """Put freed slots ``[n]`` (int64, host, checked) back on their free list."""
        self.free_slots = torch.cat([self.free_slots, slots])


class RowAllocator:
    """Rows 1..n of req_to_token (row 0 is the padding row)."""

    def __init__(self, num_usable: int):
        self.size = num_usable
        self._free = list(range(num_usable, 0, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfSlots(f"all {self.size} request rows are in use")
        row = self._free.pop()
        self._used.add(row)
        return row

    def free(self, row: int) -> None:
        if row not in self._used:
            raise ValueError(f"request row {row} is not allocated (double free?)")
        self._used.remove(row)
        self._free.append(row)


class KVMemory:
    """All pools of one engine. Tensors are created once; decode buffers point into them.

    Subclasses put parts elsewhere through the ``_make_*`` factories and the row hooks below
    (DS-Offload: engine/offload_memory.py; tensor parallelism: distributed/steps.py); the
    defaults here are the whole in-GPU memory."""

    def __init__(self, plan: MemoryPlan, device: torch.device | str):
        self.plan = plan
        self.device = torch.device(device)
        L, S, H = plan.num_layers, plan.num_slots, plan.num_kv_heads
        self.k, self.v = self._make_kv()
        # per-layer dequant scales of fp8 pools (1.0 until engine/kv_scales.py sets them); a
        # latent pool's V is its K, and so is its scale
        self.k_scale = [torch.ones(1, dtype=torch.float32, device=self.device) for _ in range(L)]
        self.v_scale = self.k_scale if plan.latent else [torch.ones(1, dtype=torch.float32, device=self.device)
                                                         for _ in range(L)]
        if plan.heavy_channel_num:
            r = plan.heavy_channel_num
            self.label = [torch.zeros(S, H, r, dtype=plan.label_dtype, device=self.device) for _ in range(L)]
            self.label_scale = [torch.ones(1, dtype=torch.float32, device=self.device) for _ in range(L)]
        else:
            self.label = [None] * L
            self.label_scale = [None] * L
        rows, ctx = plan.max_reqs + 1, plan.max_ctx
        self.req_to_token = torch.zeros(rows, ctx, dtype=torch.int32, device=self.device)
        self.req_to_token_host = torch.zeros(rows, ctx, dtype=torch.int32)
        self.slots = self._make_slots()
        self.rows = RowAllocator(plan.max_reqs)

    def _make_kv(self) -> tuple[list, list]:
        """(k, v): per layer ``[num_slots, Hkv, D]`` in the model dtype on the device; v is k for
        a latent (MLA) pool."""
        plan = self.plan
        L, S, H, D = plan.num_layers, plan.num_slots, plan.num_kv_heads, plan.head_dim
        kw = dict(dtype=plan.kv_dtype, device=self.device)
        # zeros, not empty: the padding slot must hold finite values (padded rows attend to it)
        k = [torch.zeros(S, H, D, **kw) for _ in range(L)]
        return k, k if plan.latent else [torch.zeros(S, H, D, **kw) for _ in range(L)]

    def _make_slots(self) -> SlotAllocator:
        return SlotAllocator(self.plan.max_total_tokens)

    # ------------------------------------------------------------------- request-row hooks
    def admit_row(self, row: int, tokens: int) -> bool:
        """Request row ``row`` was admitted and will allocate up to ``tokens`` new slots; returns
        whether it went to a second K/V pool. One pool here, so never (a memory with several K/V
        pools, engine/offload_memory.py, picks the row's)."""
        return False

    def caches_row(self, row: int) -> bool:
        """Whether the tokens ``row`` writes may enter the prefix cache (always here)."""
        return True

    def _forget_row(self, row: int) -> None:
        """``row`` is about to give back its slots and itself (nothing to forget here)."""

    def _alloc(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        """``[n]`` int64 host slots for the new tokens of ``rows`` ``[n]`` (one pool here)."""
        return self.slots.alloc(n)

    def assign(self, rows: torch.Tensor, positions: torch.Tensor, num_new: int,
               write_device: bool = True) -> torch.Tensor:
        """Allocate ``num_new`` slots for (row, position) pairs ``[num_new]`` (host int64) and record
        them in req_to_token (host copy always; the device copy unless ``write_device`` is False,
        for a caller whose launches write it, as the decode graphs do). Returns the slots
        ``[num_new]`` int64 on the host."""
        slots = self._alloc(rows, num_new)
        self.req_to_token_host[rows, positions] = slots.to(torch.int32)
        if not write_device:
            return slots
        # pinned + async: a pageable copy would wait for the GPU (kernels/transfer.py)
        self.req_to_token[to_device(rows, self.device), to_device(positions, self.device)] = \
            to_device(slots.to(torch.int32), self.device)
        return slots

    def release(self, row: int, length: int, start: int = 0) -> None:
        """Free a finished request's slots at positions ``[start, length)`` and its row (the
        first ``start`` belong to the prefix cache, which frees them on eviction)."""
        self._forget_row(row)
        if length > start:
            self.slots.free(self.req_to_token_host[row, start:length].to(torch.int64))
        self.req_to_token_host[row, :length] = 0
        self.rows.free(row)

    def release_row(self, row: int, start: int = 0) -> None:
        """Free every slot recorded for ``row`` from position ``start`` on and the row itself,
        whatever its length: after a step failed, a request may hold slots past the length the
        engine had counted."""
        self._forget_row(row)
        held = self.req_to_token_host[row, start:].nonzero()[:, 0] + start
        if held.numel():
            self.slots.free(self.req_to_token_host[row, held].to(torch.int64))
        self.req_to_token_host[row] = 0
        self.rows.free(row)

    # ------------------------------------------------------------ prefix-cache row plumbing
    def row_slots(self, row: int, end: int) -> torch.Tensor:
        """``[end]`` int64 host copy of the slots at positions ``0 .. end-1`` of ``row``."""
        return self.req_to_token_host[row, :end].to(torch.int64)

    def set_row_slots(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Point positions ``start ..`` of ``row`` at existing slots ``[n]`` (int64, host): a
        cached prefix, on the host and the device."""
        n = int(slots.numel())
        if not n:
            return
        s32 = slots.to(torch.int32)
        self.req_to_token_host[row, start:start + n] = s32
        self.req_to_token[row, start:start + n] = to_device(s32, self.device)

    def free_row_range(self, row: int, start: int, stop: int) -> None:
        """Free the slots at positions ``[start, stop)`` of ``row`` (they are about to be
        replaced by cached ones)."""
        if stop > start:
            self.slots.free(self.req_to_token_host[row, start:stop].to(torch.int64))
            self.req_to_token_host[row, start:stop] = 0

    def free_values(self, values) -> None:
        """Free slot tensors the prefix cache gave up (int64 host tensors)."""
        if values:
            self.slots.free(torch.cat([v.reshape(-1) for v in values]))

    def _device_kv(self) -> list:
        """The K/V tensors this memory holds on the device (a latent pool once)."""
        return [*self.k, *(() if self.plan.latent else self.v)]

    @property
    def nbytes(self) -> int:
        """Bytes of the pools on the device."""
        t = [*self._device_kv(), *(x for x in self.label if x is not None), self.req_to_token]
        return sum(x.numel() * x.element_size() for x in t)
