"""Building an engine's parts from an EngineConfig: model, channels, pools, backend, runner.

Shared by :class:`~doublesparse.engine.engine.Engine` and ``bench_one_batch`` so both run the
exact same stack. Channels come from :mod:`doublesparse.channels`; an on-demand calibration
(``--ds-channel-config-path auto``) is handed in by whoever builds the engine
(:class:`OnDemandCalibration`), since calibration stands above the engine and runs it.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..attention import DSParams, create_backend, prefill
from ..attention.budget import DecodeCost, DecodePolicy
from ..channels import default_channels, load_channels, packaged_config_path, read_config, recorded_modes
from ..config import OFFLOAD_SELECTION_MODE, EngineConfig
from ..kernels.workspace import DecodeWorkspace
from .memory import KVMemory, MemoryPlan, plan_memory
from .model_runner import ModelRunner
from . import operating_point
from .operating_point import OperatingPoint
from .scheduler import Scheduler

log = logging.getLogger("doublesparse.engine")
_UNSET = object()
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


def load(cfg: EngineConfig, device: torch.device, progress: bool, tp=None):
    """The model and tokenizer through :mod:`doublesparse.models` (``tp``: this tensor-parallel
    rank's part of the model; only rank 0 has a tokenizer)."""
    from ..models import load_model, load_tokenizer
    dtype = None if cfg.dtype in (None, "auto") else cfg.dtype
    if tp is not None:
        model = tp.load_model(cfg, device, dtype, progress)
        if tp.rank:
            return model, None
    else:
        model = load_model(cfg.model_path, load_format=cfg.load_format, dtype=dtype, device=str(device),
                           progress=progress, seed=cfg.seed,
                           packed=device.type == "cpu" and not cfg.disable_cpu_packed_weights)
    if cfg.load_format == "dummy":
        try:  # a shipped config name has no tokenizer; a real folder may
            tok = load_tokenizer(cfg.model_path)
        except (OSError, ValueError):
            tok = None
    else:
        tok = load_tokenizer(cfg.model_path)
    return model, tok


@dataclass(frozen=True)
class ChannelChoice:
    """Heavy channels ``[num_layers, Hkv, r]`` long, where they came from, each layer's selection
    mode, and whether they were calibrated (a channel config) or guessed (weight-based)."""

    channels: torch.Tensor
    source: str
    modes: tuple[str, ...]
    calibrated: bool


UNCALIBRATED = ("no calibrated channel config: using weight-based heavy channels, which lose "
                "accuracy on some models; pass --ds-channel-config-path auto to calibrate once "
                "(cached) or a config written by `doublesparse calibrate`")
NO_CALIBRATION = ("--ds-channel-config-path auto calibrates on demand, which this engine was built "
                  "without: build it as doublesparse.Engine (or pass calibrate=), or pass a config "
                  "written by `doublesparse calibrate`")


class OnDemandCalibration(Protocol):
    """``--ds-channel-config-path auto``: the path of a calibrated channel config for ``model``
    (measured on its device the first time, then read from a cache). ``model_file``: the
    checkpoint it was loaded from (keys the cache), None for a model built by the caller."""

    def __call__(self, model, tokenizer, model_file: str | None, progress: bool = True) -> Path: ...


def channel_config_path(cfg: EngineConfig, model, mc, tokenizer=None, model_file: str | None = None,
                        progress: bool = True, shard=None, calibrate: OnDemandCalibration | None = None):
    """``--ds-channel-config-path`` (``auto``: ``calibrate``'s, on demand), else the packaged
    config for the model, else None."""
    path = cfg.ds_channel_config_path
    if path == "auto" and shard is not None:
        raise ValueError("--ds-channel-config-path auto calibrates on one device: run `doublesparse "
                         "calibrate` (or this command with --tp-size 1) once and pass the config it writes")
    if path == "auto":
        if calibrate is None:
            raise ValueError(NO_CALIBRATION)
        path = calibrate(model, tokenizer, model_file, progress=progress)
    if path is None and cfg.load_format != "dummy":
        path = packaged_config_path(getattr(mc, "name", None))
    return path


def resolve_point(mc, path) -> OperatingPoint:
    """The model's operating point: the one the channel config at ``path`` records, else the
    shape default (with the config's recorded per-layer modes where it has them)."""
    raw = read_config(path) if path is not None else None
    L = int(mc.num_layers)
    recorded = recorded_modes(raw, L) if raw is not None else None
    return operating_point.resolve(raw, int(mc.num_q_heads), int(mc.num_kv_heads), int(mc.head_dim), L, recorded,
                                   latent=getattr(mc, "mla", None) is not None)


def resolve_channels(cfg: EngineConfig, model, mc, r: int, tokenizer=None,
                     model_file: str | None = None, progress: bool = True, shard=None,
                     path=_UNSET, point: OperatingPoint | None = None,
                     calibrate: OnDemandCalibration | None = None) -> ChannelChoice:
    """Channels of the config at ``path`` (default: :func:`channel_config_path`), else the
    documented weight-based default. Modes: an explicit ``--ds-selection-mode`` for every layer,
    else ("auto") the operating point's (``point``, default :func:`resolve_point`): the config's
    calibrated ones, else from the model's shape. ``shard``: a tensor-parallel rank's part (a
    config's channels are read for the full model, then its KV heads taken; weight-based ones
    come from its own weights)."""
    if path is _UNSET:
        path = channel_config_path(cfg, model, mc, tokenizer, model_file, progress, shard, calibrate)
    point = point or resolve_point(mc, path)
    L = int(mc.num_layers)
    explicit = cfg.ds_selection_mode != "auto"
    modes = (cfg.ds_selection_mode,) * L if explicit else point.modes(L)
    if cfg.enable_ds_offload and not explicit:
        # DS-Offload fetches whole tokens (2 KB rows at PCIe speed) under one selection per layer
        modes = (OFFLOAD_SELECTION_MODE,) * L
    how = f"mode {modes[0]}" if len(set(modes)) == 1 else "modes per layer from the config"
    if path is not None:
        ch = load_channels(path, mc if shard is None else shard.config, cfg.ds_heavy_channel_type, r, modes)
        if shard is not None:
            ch = shard.channels(ch)
        return ChannelChoice(ch, f"channel config {path} ({how})", modes, True)
    try:
        ch = default_channels(model, r, cfg.ds_heavy_channel_type)
        src = f"weight-based default channels (no channel config; r={r}, type={cfg.ds_heavy_channel_type})"
    except (ValueError, AttributeError, KeyError) as e:
        warnings.warn(f"default_channels failed ({e}); using the first {r} channels")
        ch, src = _first_channels(mc, r), f"first {r} channels (no usable weights)"
    return ChannelChoice(ch, src, modes, False)


def ds_params(cfg: EngineConfig, plan: MemoryPlan, num_q_heads: int, device: torch.device,
              modes: tuple[str, ...] | None = None, sink_recent: tuple[int, int] = (4, 32)) -> DSParams:
    """Each request's budget, the dense/sparse choice (its cost model reads what a token costs in
    these pools and the tuning's figures for this kind of device), the forced tokens (where
    unset, ``sink_recent``: the operating point's) and each layer's selection mode (``modes``;
    default: the config's fallback for every layer)."""
    budget = cfg.token_budget(plan.max_ctx)
    modes = tuple(modes or (cfg.selection_mode_fallback,) * plan.num_layers)
    rows = sum(num_q_heads if m == "per_head" else plan.num_kv_heads for m in modes)
    bandwidth, per_layer = cfg.kernel_tuning.decode_cost_figures(device.type)
    cost = DecodeCost(kv_bytes_per_token=plan.kv_bytes_per_token,
                      label_bytes_per_token=plan.label_bytes_per_token,
                      selected_bytes_per_token=(1 if plan.latent else 2) * rows * plan.head_dim * plan.kv_dtype.itemsize,
                      bandwidth=bandwidth, sparse_step_overhead_s=per_layer * plan.num_layers)
    policy = DecodePolicy(budget, cfg.ds_sparse_decode_threshold, cost)
    main = max(dict.fromkeys(modes), key=modes.count)  # the most common; ties: the first layer's
    return DSParams(budget.k_max, main, cfg.ds_sparse_decode_threshold,
                    *cfg.sink_recent(budget.k_min, sink_recent), batch_parts=cfg.ds_batch_parts or 0, policy=policy,
                    layer_modes=modes if len(set(modes)) > 1 else ())


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


def _first_channels(mc, r: int) -> torch.Tensor:
    return torch.arange(r).expand(mc.num_layers, mc.num_kv_heads, r).clone()


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
    None with ``--tp-size 1``. ``calibrate``: the on-demand calibration that
    ``--ds-channel-config-path auto`` runs (None: that setting is refused)."""
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
        if tp is not None:
            model = tp.shard_model(model, device)
        if tokenizer is _UNSET:
            tokenizer = None
    mc = model.config  # with tensor parallelism: this rank's heads and widths
    max_ctx = int(mc.max_position_embeddings)
    if cfg.context_length:
        max_ctx = min(max_ctx, cfg.context_length)
    if getattr(mc, "sliding_window", None) and mc.sliding_window < max_ctx:
        warnings.warn(f"model uses a sliding window of {mc.sliding_window}; the engine attends to the "
                      f"full context (capping the context at {mc.sliding_window} keeps it exact)")
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
        from .offload_setup import plan_offload_memory
        plan = plan_offload_memory(cfg, mc, _model_dtype(model), device, max_ctx, r)
    else:
        plan = plan_memory(cfg, mc, _model_dtype(model), device, max_ctx, r)
    if tp is not None:
        plan = tp.agree(plan, device)
    if cfg.use_double_sparsity:
        choice = resolve_channels(cfg, model, mc, r, tokenizer, model_file, progress, shard, path, point)
        ds = ds_params(cfg, plan, mc.num_q_heads, device, choice.modes, point.sink_recent)
        channels = choice.channels.to(device=device, dtype=torch.int32).contiguous()
        log.info("Double Sparsity: %s; r=%d, %s", ds.policy.describe(), r, choice.source)
        log.info("Double Sparsity: %s%s", point.describe(), _overrides(point, user_cfg))
        if not choice.calibrated:
            log.warning("Double Sparsity: %s", UNCALIBRATED)
    max_bs = cfg.resolved_max_running_requests
    ws = None
    if device.type == "cuda":
        ws = DecodeWorkspace(max_batch=max_bs,
                             num_q_heads=mc.num_q_heads, num_kv_heads=mc.num_kv_heads,
                             head_dim=mc.head_dim, max_ctx=max_ctx,
                             k_max=ds.k_max if ds else 0, device=device,
                             layer_select=ds is not None and any(ds.mode_of(i) == "layer"
                                                                 for i in range(plan.num_layers)))
    if cfg.enable_ds_offload:
        from .offload_setup import build_offload
        memory, backend = build_offload(cfg, plan, device, ds, mc, channels, ws)
        ds = backend.ds  # its policy: sparse whenever a request is longer than its k
    else:
        memory = KVMemory(plan, device) if tp is None else tp.memory(plan, device)
        backend = create_backend(cfg.resolved_attention_backend, use_double_sparsity=ds is not None, ds=ds,
                                 memory=memory, num_q_heads=mc.num_q_heads, head_dim=mc.head_dim,
                                 impl=cfg.kernel_impl, workspace=ws, channels=channels, tuning=cfg.kernel_tuning)
    if cfg.kv_cache_fp8:
        from .kv_scales import DEFAULT_SOURCE, apply_scales, resolve_scales
        k_sc, v_sc, src = resolve_scales(cfg, model_file, plan.num_layers)
        apply_scales(memory, k_sc, v_sc)
        rotation = _k_rotation(cfg, backend, plan, mc, channels, _model_dtype(model), device, src == DEFAULT_SOURCE)
        log.info("fp8 KV cache (%s): per-layer scales from %s; %s", cfg.kv_cache_dtype, src, rotation)
    elif cfg.kv_cache_k_rotation == "hadamard":
        log.info("KV cache: %s", _k_rotation(cfg, backend, plan, mc, channels, _model_dtype(model), device))
    log.info("%s", plan.describe())
    if cfg.gpu_memory_budget_gb is not None:
        from .offload_setup import check_gpu_budget, device_use
        check_gpu_budget(cfg, device_use(model, memory, backend, ws))
    if device.type == "cuda" and max_ctx > prefill.SPLIT_MIN_TOKENS:
        with torch.inference_mode():
            prefill.warmup(device, _model_dtype(model), mc.num_q_heads, mc.num_kv_heads, mc.head_dim,
                           cfg.kernel_tuning)
    recall = _recall_probe(cfg, backend, plan, ds, tp)
    adaptive = None
    if ds is not None and cfg.budget_mode == "adaptive":
        from ..attention import adaptive as adaptive_budget
        adaptive = adaptive_budget.build(cfg.adaptive_config, backend, recall, plan, mc.num_q_heads)
    runner = (ModelRunner if tp is None else tp.runner)(
        model, memory, backend, device, use_cuda_graph=cfg.use_cuda_graph,
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


def _k_rotation(cfg: EngineConfig, backend, plan: MemoryPlan, mc, channels, dtype, device,
                default_scales: bool = True) -> str:
    """Set the backend's q/K rotation (``--kv-cache-k-rotation``; attention/k_rotation.py) from
    this rank's heads, before any CUDA graph is captured (label channels stay unrotated); returns
    its words for the startup line. default_scales: the fp8 scales are the default 1.0."""
    from ..attention import k_rotation
    if not k_rotation.resolve(cfg.kv_cache_k_rotation, cfg.kv_cache_fp8, plan.latent, default_scales):
        return k_rotation.describe(None, None)
    rot = k_rotation.rotation_matrices(plan.num_layers, mc.num_kv_heads, mc.head_dim)
    backend.k_rotation = rot.to(device=device, dtype=dtype)
    return k_rotation.describe(rot, channels)


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


def _overrides(point: OperatingPoint, user_cfg: EngineConfig) -> str:
    over = point.overridden(user_cfg)
    return ("; flags override " + ", ".join(f"{k}={v}" for k, v in over.items())) if over else ""
