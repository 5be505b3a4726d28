"""Building an engine's parts from an EngineConfig: model, channels, pools, backend, runner.

Shared by :class:`~doublesparse.engine.engine.Engine` and ``bench_one_batch`` so both run the
exact same stack. Double Sparsity's share (channel config, operating point, channels, decode
parameters) is :mod:`.ds_setup`'s, DS-Offload's (host store, hot set, its backend)
:mod:`.offload_setup`'s. Where the parts live, this process alone or one tensor-parallel rank,
is one object with the same methods either way (:class:`OneProcess`,
:class:`~doublesparse.distributed.rank.RankContext`).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

from ..attention import DSParams, create_backend, prefill
from ..config import EngineConfig
from ..kernels.workspace import DecodeWorkspace
from .ds_setup import (UNCALIBRATED, OnDemandCalibration, channel_config_path, ds_params, overrides,
                       resolve_channels, resolve_point)
from .memory import KVMemory, MemoryPlan, plan_memory
from .model_runner import ModelRunner
from .scheduler import Scheduler

log = logging.getLogger("doublesparse.engine")
_UNSET = object()


@dataclass
class EngineParts:
    model: object
    tokenizer: object
    device: torch.device
    max_context_len: int
    plan: MemoryPlan
    memory: KVMemory
    backend: object
    runner: ModelRunner
    scheduler: Scheduler
    ds: DSParams | None
    channel_source: str | None
    workspace: DecodeWorkspace | None
    channels_calibrated: bool | None = None  # None: Double Sparsity off
    # the operating point in use (OperatingPoint.as_dict with the flags that override it); None: DS off
    operating_point: dict | None = None
    # the sampled attention recall (attention/recall.py); None: off, or not available (DS off,
    # DS-Offload, tensor parallelism)
    recall: object | None = None
    # the adaptive budget's per-layer scales (attention/adaptive.py); None: another budget mode
    adaptive: object | None = None

    def sparse_rows(self, seq_lens: list[int]) -> list[bool]:
        """Per request of a decode step (lengths after the step): did it select tokens?"""
        return self.backend.sparse_rows(seq_lens)


class OneProcess:
    """Where the parts live with ``--tp-size 1``: this process alone, with the whole model. A
    tensor-parallel rank's counterpart, with the same methods, is
    :class:`~doublesparse.distributed.rank.RankContext`."""

    rank = 0

    def load_model(self, cfg: EngineConfig, device: torch.device, dtype: str | None, progress: bool):
        from ..models import load_model
        return load_model(cfg.model_path, load_format=cfg.load_format, dtype=dtype, device=str(device),
                          progress=progress, seed=cfg.seed,
                          packed=device.type == "cpu" and not cfg.disable_cpu_packed_weights)

    def shard_model(self, model, device):
        return model

    def agree(self, plan: MemoryPlan, device) -> MemoryPlan:
        return plan

    def memory(self, plan: MemoryPlan, device) -> KVMemory:
        return KVMemory(plan, device)

    def runner(self, *args, **kwargs) -> ModelRunner:
        return ModelRunner(*args, **kwargs)


class InGPUTier:
    """K/V in the device pools (:mod:`.memory`), read by the backend ``--attention-backend`` names.
    DS-Offload's counterpart, with the same methods, is :class:`.offload_setup.OffloadTier`."""

    def __init__(self, cfg: EngineConfig, proc):
        self.cfg, self.proc = cfg, proc

    def plan(self, model_config, kv_dtype: torch.dtype, device: torch.device, max_ctx: int, r: int) -> MemoryPlan:
        return plan_memory(self.cfg, model_config, kv_dtype, device, max_ctx, r)

    def build(self, plan: MemoryPlan, device: torch.device, ds: DSParams | None, mc, channels, workspace):
        """(memory, backend, the backend's DSParams) over ``plan``'s pools."""
        cfg = self.cfg
        memory = self.proc.memory(plan, device)
        backend = create_backend(cfg.resolved_attention_backend, use_double_sparsity=ds is not None, ds=ds,
                                 memory=memory, num_q_heads=mc.num_q_heads, head_dim=mc.head_dim,
                                 impl=cfg.kernel_impl, workspace=workspace, channels=channels,
                                 tuning=cfg.kernel_tuning)
        return memory, backend, ds


def load(cfg: EngineConfig, device: torch.device, progress: bool, tp=None):
    """The model and tokenizer through :mod:`doublesparse.models` (``tp``: this tensor-parallel
    rank's part of the model; only rank 0 has a tokenizer)."""
    from ..models import load_tokenizer
    dtype = None if cfg.dtype in (None, "auto") else cfg.dtype
    proc = OneProcess() if tp is None else tp
    model = proc.load_model(cfg, device, dtype, progress)
    if proc.rank:
        return model, None
    try:
        tok = load_tokenizer(cfg.model_path)
    except (OSError, ValueError):
        if cfg.load_format != "dummy":
            raise
        tok = None  # a shipped config name has no tokenizer; a real folder may
    return model, tok


def resolve_model_file(cfg: EngineConfig) -> str | None:
    """The checkpoint file or folder the engine loads (the embedded model's GGUF when no path is
    given), or None for dummy weights or when the embedded model is missing."""
    if cfg.load_format == "dummy":
        return None
    if cfg.model_path:
        return cfg.model_path
    from ..models.loader import default_model_path
    try:
        return str(default_model_path())
    except FileNotFoundError:
        return None


def _model_dtype(model) -> torch.dtype:
    d = getattr(model, "dtype", None)
    if isinstance(d, torch.dtype):
        return d
    return next(model.parameters()).dtype


def _model_device(model) -> torch.device:
    d = getattr(model, "device", None)
    return d if isinstance(d, torch.device) else next(model.parameters()).device


def build_parts(cfg: EngineConfig, model=None, tokenizer=_UNSET, progress: bool = True,
                tp=None, calibrate: OnDemandCalibration | None = None) -> EngineParts:
    """``tp``: this tensor-parallel rank (:class:`~doublesparse.distributed.rank.RankContext`);
    None with ``--tp-size 1`` (:class:`OneProcess`). ``calibrate``: the on-demand calibration that
    ``--ds-channel-config-path auto`` runs (None: that setting is refused)."""
    proc = OneProcess() if tp is None else tp
    device = torch.device(cfg.resolved_device)
    if model is not None and not cfg.device:
        # A model built by the caller runs where it lives (a CPU model on a GPU machine too).
        device = _model_device(model)
        cfg = cfg.replace(device=str(device))
    # the file the model was loaded from keys the on-demand calibration's cache; a model built by
    # the caller has none (its weights are hashed instead)
    model_file = None
    if model is None:
        model_file = resolve_model_file(cfg)
        model, loaded_tok = load(cfg, device, progress, tp)
        tokenizer = loaded_tok if tokenizer is _UNSET or tokenizer is None else tokenizer
    else:
        model = proc.shard_model(model, device)
        if tokenizer is _UNSET:
            tokenizer = None
    mc = model.config  # with tensor parallelism: this rank's heads and widths
    dtype = _model_dtype(model)
    max_ctx = _context_len(mc, cfg.context_length)
    ds = channels = choice = point = None
    user_cfg = cfg
    if cfg.use_double_sparsity:
        # the operating point fills the fields the user left unset; it sets r, which sizes the
        # label pool, so it is read before the memory plan (an on-demand calibration runs here too)
        shard = None if tp is None else tp.shard(model.full_config)
        path = channel_config_path(cfg, model, mc, tokenizer, model_file, progress, shard, calibrate)
        point = resolve_point(mc, path)
        cfg = point.fill(cfg)
    r = cfg.heavy_channel_num(mc.head_dim) if cfg.use_double_sparsity else 0
    if cfg.enable_ds_offload:
        from .offload_setup import OffloadTier
        tier = OffloadTier(cfg)
    else:
        tier = InGPUTier(cfg, proc)
    plan = proc.agree(tier.plan(mc, dtype, device, max_ctx, r), device)
    if cfg.use_double_sparsity:
        choice = resolve_channels(cfg, model, mc, r, tokenizer, model_file, progress, shard, path, point)
        ds = ds_params(cfg, plan, mc.num_q_heads, device, choice.modes, point.sink_recent)
        channels = choice.channels.to(device=device, dtype=torch.int32).contiguous()
        log.info("Double Sparsity: %s; r=%d, %s", ds.policy.describe(), r, choice.source)
        log.info("Double Sparsity: %s%s", point.describe(), overrides(point, user_cfg))
        if not choice.calibrated:
            log.warning("Double Sparsity: %s", UNCALIBRATED)
    ws = _workspace(cfg, plan, ds, mc, device, max_ctx)
    memory, backend, ds = tier.build(plan, device, ds, mc, channels, ws)
    _kv_cache(cfg, memory, backend, plan, mc, channels, dtype, device, model_file)
    log.info("%s", plan.describe())
    if cfg.gpu_memory_budget_gb is not None:
        from .offload_setup import check_gpu_budget, device_use
        check_gpu_budget(cfg, device_use(model, memory, backend, ws))
    if device.type == "cuda" and max_ctx > prefill.SPLIT_MIN_TOKENS:
        with torch.inference_mode():
            prefill.warmup(device, dtype, mc.num_q_heads, mc.num_kv_heads, mc.head_dim, cfg.kernel_tuning,
                           backend.cudnn_shapes)
    recall = _recall_probe(cfg, backend, plan, ds, tp)
    adaptive = None
    if ds is not None and cfg.budget_mode == "adaptive":
        from ..attention import adaptive as adaptive_budget
        adaptive = adaptive_budget.build(cfg.adaptive_config, backend, recall, plan, mc.num_q_heads)
    runner = proc.runner(model, memory, backend, device, use_cuda_graph=cfg.use_cuda_graph,
                         graph_max_bs=cfg.cuda_graph_max_bs, tuning=cfg.kernel_tuning, cpu_threads=cfg.cpu_threads)
    if recall is not None:
        recall.attach_runner(runner)
    if adaptive is not None:  # after the probe: its update follows the probe's end of step
        adaptive.attach_runner(runner)
    # all slots in-GPU; with DS-Offload the host store's only (its device tier is on top, so
    # every request fits whichever tier the memory puts it in)
    scheduler = Scheduler(cfg.scheduler_config(), memory.slots.admission_size, max_ctx)
    return EngineParts(model, tokenizer, device, max_ctx, plan, memory, backend, runner, scheduler,
                       ds, choice.source if choice else None, ws,
                       choice.calibrated if choice else None,
                       point.as_dict(user_cfg) if point is not None else None, recall, adaptive)


def _context_len(mc, context_length: int | None) -> int:
    """The longest context: the model's, capped at ``--context-length``."""
    max_ctx = int(mc.max_position_embeddings)
    if context_length:
        max_ctx = min(max_ctx, context_length)
    if getattr(mc, "sliding_window", None) and mc.sliding_window < max_ctx:
        warnings.warn(f"model uses a sliding window of {mc.sliding_window}; the engine attends to the "
                      f"full context (capping the context at {mc.sliding_window} keeps it exact)")
    return max_ctx


def _workspace(cfg: EngineConfig, plan: MemoryPlan, ds: DSParams | None, mc, device: torch.device,
               max_ctx: int) -> DecodeWorkspace | None:
    """The decode kernels' scratch on CUDA, at the largest batch, context and k (None elsewhere)."""
    if device.type != "cuda":
        return None
    return DecodeWorkspace(max_batch=cfg.resolved_max_running_requests,
                           num_q_heads=mc.num_q_heads, num_kv_heads=mc.num_kv_heads,
                           head_dim=mc.head_dim, max_ctx=max_ctx,
                           k_max=ds.k_max if ds else 0, device=device,
                           layer_select=ds is not None and any(ds.mode_of(i) == "layer"
                                                               for i in range(plan.num_layers)))


def _kv_cache(cfg: EngineConfig, memory, backend, plan: MemoryPlan, mc, channels, dtype: torch.dtype,
              device: torch.device, model_file: str | None) -> None:
    """An fp8 cache's per-layer scales (engine/kv_scales.py), and the backend's q/K rotation
    (``--kv-cache-k-rotation``; attention/k_rotation.py) from this rank's heads (label channels
    stay unrotated), both set before any CUDA graph is captured and named on the startup line."""
    if not cfg.kv_cache_fp8 and cfg.kv_cache_k_rotation != "hadamard":
        return
    from ..attention import k_rotation
    default_scales = True  # the fp8 scales are the default 1.0 (auto rotates only then)
    if cfg.kv_cache_fp8:
        from .kv_scales import DEFAULT_SOURCE, apply_scales, resolve_scales
        k_sc, v_sc, src = resolve_scales(cfg, model_file, plan.num_layers)
        apply_scales(memory, k_sc, v_sc)
        default_scales = src == DEFAULT_SOURCE
    rot = None
    if k_rotation.resolve(cfg.kv_cache_k_rotation, cfg.kv_cache_fp8, plan.latent, default_scales):
        rot = k_rotation.rotation_matrices(plan.num_layers, mc.num_kv_heads, mc.head_dim)
        backend.k_rotation = k_rotation.shared(rot).to(device=device, dtype=dtype)
    rotation = k_rotation.describe(rot, None if rot is None else channels)
    if cfg.kv_cache_fp8:
        log.info("fp8 KV cache (%s): per-layer scales from %s; %s", cfg.kv_cache_dtype, src, rotation)
    else:
        log.info("KV cache: %s", rotation)


def _recall_probe(cfg: EngineConfig, backend, plan: MemoryPlan, ds, tp):
    """The sampled recall, attached to the backend before any CUDA graph is captured; None where
    it is off or not available (its exact attention reads the device K/V pools of one process)."""
    if ds is None or not cfg.ds_recall_sample_interval or cfg.enable_ds_offload or tp is not None:
        return None
    from ..attention.recall import RecallConfig, RecallProbe
    probe = RecallProbe(RecallConfig(cfg.ds_recall_sample_interval, cfg.ds_recall_sample_rows), backend,
                        plan.num_layers)
    probe.attach(backend)
    return probe
