"""Double Sparsity's part of building an engine: the channel config, the model's operating point
(which fills the flags left unset), the heavy channels and each layer's selection mode, and the
decode parameters (:class:`~doublesparse.attention.DSParams`) that the backend is built with.

An on-demand calibration (``--ds-channel-config-path auto``) is handed in by whoever builds the
engine (:class:`OnDemandCalibration`), since calibration stands above the engine and runs it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..attention import DSParams
from ..attention.budget import DecodeCost, DecodePolicy
from ..channels import default_channels, load_channels, packaged_config_path, read_config, recorded_modes
from ..config import OFFLOAD_SELECTION_MODE, EngineConfig
from . import operating_point
from .memory import MemoryPlan
from .operating_point import OperatingPoint

_UNSET = object()


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


def _first_channels(mc, r: int) -> torch.Tensor:
    return torch.arange(r).expand(mc.num_layers, mc.num_kv_heads, r).clone()


def overrides(point: OperatingPoint, user_cfg: EngineConfig) -> str:
    over = point.overridden(user_cfg)
    return ("; flags override " + ", ".join(f"{k}={v}" for k, v in over.items())) if over else ""
