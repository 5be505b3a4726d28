"""Building the DS-Offload parts of an engine (host store, hot set, backend) and holding an engine
to a GPU memory budget (``--gpu-memory-budget-gb``, standing for a smaller card)."""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..attention.offload import OffloadDSBackend, hot_units
from ..attention.offload_hot import HotSet
from .host_kv import GIB, HostKVStore, host_tokens
from .memory import KVMemory, MemoryPlan, dtype_name, kv_cache_dtype, plan_memory
from .offload_memory import OffloadKVMemory

log = logging.getLogger("doublesparse.engine")


_LOWER = ("lower --max-total-tokens, --max-running-requests, --ds-offload-hot-tokens or the largest top-k "
          "(--ds-heavy-token-num, --ds-heavy-token-max: the hot set holds at least k rows per request)")


def plan_offload_memory(cfg, model_config, kv_dtype, device: torch.device, max_ctx: int, r: int) -> MemoryPlan:
    """The pools' plan when K/V live in the host store: as many slots as the host bound holds
    (or ``--max-total-tokens``) at the bytes of ``--kv-cache-dtype`` (an fp8 store holds twice
    bf16's tokens); the device keeps labels and req_to_token only. kv_dtype: the model's."""
    mc = model_config
    if getattr(mc, "mla", None) is not None:
        raise ValueError("--enable-ds-offload supports models with K and V heads (not MLA latent pools)")
    per_token = mc.kv_bytes_per_token(kv_cache_dtype(cfg, kv_dtype).itemsize)
    tokens = host_tokens(cfg.max_total_tokens, cfg.ds_offload_host_memory_gb, device.type, per_token)
    # the device tier's slots come first (1 .. device tokens), the host store's after them
    return plan_memory(cfg.replace(max_total_tokens=tokens + cfg.ds_offload_device_tokens), mc, kv_dtype,
                       device, max_ctx, r)


def hot_tokens(cfg, k_max: int) -> int:
    """Hot-set rows per (request, layer, KV head): ``--ds-offload-hot-tokens``, else 2 x k_max."""
    n = cfg.ds_offload_hot_tokens or 2 * k_max
    if n < k_max:
        raise ValueError(f"--ds-offload-hot-tokens {n} is below the largest top-k {k_max}: "
                         "a step's selection must fit the hot set")
    return n


def build_offload(cfg, plan: MemoryPlan, device: torch.device, ds, mc, channels, workspace):
    """(memory, backend) of an offloading engine: an :class:`OffloadKVMemory` with K/V in a host
    store (pinned on CUDA) and labels in the device pool, and the offload backend with a hot set
    of ``hot_tokens`` rows per request row (padding row included); store, device tier and hot set
    in ``plan.kv_dtype`` (``--kv-cache-dtype``: fp8 rows with the memory's per-layer scales, which
    build_parts fills after this). build_parts injects both in place of the in-GPU memory and
    backend."""
    n_dev = cfg.ds_offload_device_tokens
    if n_dev and device.type == "cuda":
        need = (n_dev + 1) * plan.kv_bytes_per_token
        free = torch.cuda.mem_get_info(device)[0]
        if need > free:
            raise ValueError(f"the DS-Offload device tier of {n_dev} tokens needs {need / GIB:.1f} GiB, "
                             f"{free / GIB:.1f} GiB are free: lower --ds-offload-device-tokens")
    store = HostKVStore(plan.num_layers, plan.num_slots, plan.num_kv_heads, plan.head_dim,
                        plan.kv_dtype, pin=device.type == "cuda", device_tokens=n_dev, device=device)
    memory = OffloadKVMemory(plan, device, store)
    C = hot_tokens(cfg, ds.k_max)
    # rows of whole tokens under the layer selection mode, else per (token, KV head)
    units = hot_units(ds, plan.num_layers, plan.num_kv_heads)
    width = plan.num_kv_heads * plan.head_dim // units
    if device.type == "cuda":
        need = HotSet.bytes_for(plan.num_layers, plan.max_reqs + 1, C, units, width,
                                plan.num_slots, plan.kv_dtype.itemsize)
        free = torch.cuda.mem_get_info(device)[0]
        if need > free:
            raise ValueError(f"the DS-Offload hot set needs {need / GIB:.1f} GiB ({plan.max_reqs + 1} request rows "
                             f"x {C} tokens x {plan.num_layers} layers), {free / GIB:.1f} GiB are free: {_LOWER}")
    hot = HotSet(plan.num_layers, plan.max_reqs + 1, C, units, width, plan.num_slots, plan.kv_dtype, device)
    memory.row_release_hooks.append(hot.reset_region)
    impl = "torch" if cfg.kernel_impl == "torch" else "auto"
    backend = OffloadDSBackend(memory, mc.num_q_heads, mc.head_dim, impl=impl, workspace=workspace,
                               channels=channels, ds=ds, tuning=cfg.kernel_tuning, hot=hot,
                               fetch=cfg.ds_offload_fetch, prefetch=cfg.ds_offload_prefetch)
    log.info("DS-Offload: K/V of %d tokens in host memory (%.1f GiB, %s)%s, hot set %d %s per "
             "request and layer, fetch %s; prefix cache %s",
             memory.slots.admission_size, store.nbytes / 2**30, dtype_name(plan.kv_dtype),
             f", a device tier of {n_dev} tokens" if n_dev else "", hot.capacity,
             "tokens (all KV heads)" if units == 1 else "tokens per KV head", backend.fetch,
             "off" if cfg.disable_radix_cache else "on (cached prefixes in the host store)")
    return memory, backend


class OffloadTier:
    """K/V in a host store, labels and a hot set on the device (``--enable-ds-offload``): the plan of
    :func:`plan_offload_memory`, the memory and backend of :func:`build_offload`. The in-GPU
    counterpart, with the same methods, is :class:`.setup.InGPUTier`."""

    def __init__(self, cfg):
        self.cfg = cfg

    def plan(self, model_config, kv_dtype: torch.dtype, device: torch.device, max_ctx: int, r: int) -> MemoryPlan:
        return plan_offload_memory(self.cfg, model_config, kv_dtype, device, max_ctx, r)

    def build(self, plan: MemoryPlan, device: torch.device, ds, mc, channels, workspace):
        """(memory, backend, the backend's DSParams: sparse whenever a request is longer than its k)."""
        memory, backend = build_offload(self.cfg, plan, device, ds, mc, channels, workspace)
        return memory, backend, backend.ds


@dataclasses.dataclass(frozen=True)
class DeviceUse:
    """Bytes an engine holds on its device, by part."""

    weights: int
    pools: int
    hot_set: int
    workspace: int

    @property
    def total(self) -> int:
        return self.weights + self.pools + self.hot_set + self.workspace

    def describe(self) -> str:
        return (f"weights {self.weights / GIB:.2f} + pools {self.pools / GIB:.2f} + hot set "
                f"{self.hot_set / GIB:.2f} + workspace {self.workspace / GIB:.2f} = {self.total / GIB:.2f} GiB")


def device_use(model, memory: KVMemory, backend, workspace) -> DeviceUse:
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    hot = getattr(backend, "hot", None)
    return DeviceUse(weights, memory.nbytes, hot.nbytes if hot is not None else 0,
                     workspace.nbytes if workspace is not None else 0)


def check_gpu_budget(cfg, use: DeviceUse) -> None:
    """Raise when the engine's device memory exceeds ``--gpu-memory-budget-gb`` (nothing without it)."""
    gb = cfg.gpu_memory_budget_gb
    if gb is None or use.total <= gb * GIB:
        return
    hint = _LOWER if cfg.enable_ds_offload else "lower --max-total-tokens or pass --enable-ds-offload"
    raise ValueError(f"the engine needs {use.describe()} of device memory, over --gpu-memory-budget-gb "
                     f"{gb}; {hint}")

