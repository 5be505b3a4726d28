"""A rank's part of a model: built at its local config, made parallel, filled with its slices.

Three sources, one slicing rule (:meth:`~.shard.Shard.tensor`):
  * dummy weights: each full tensor is drawn on the rank's device from the seed in the order and
    dtype :func:`~doublesparse.models.weights.init_dummy_weights` draws them, then sliced, so a
    dummy model is the same model at every ``--tp-size`` (one full tensor in memory at a time);
  * a checkpoint (safetensors, GGUF): loaded whole on the CPU, then sliced (host memory for the
    full model on every rank: fine for the models that fit one host many times over);
  * a model object built by the caller (tests): sliced from its parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..models import load_model
from ..models.loader import resolve_dtype, resolve_model_path
from ..models.config import ModelConfig
from ..models.registry import model_class
from .layers import Collectives, parallelize
from .shard import Shard, check_tp


def build_local(config: ModelConfig, comm: Collectives, device, dtype: torch.dtype,
                max_positions: int | None = None) -> nn.Module:
    """Rank ``comm.rank``'s model of ``config`` (parallel layers in place), parameters uninitialised."""
    check_tp(config, comm.size)
    local = Shard(config, comm.rank, comm.size).local_config()
    model = model_class(config.architecture)(local, device=device, dtype=dtype, max_positions=max_positions)
    return parallelize(model, config, comm)


@torch.no_grad()
def fill(model: nn.Module, named_full: Iterable[tuple[str, torch.Tensor]]) -> nn.Module:
    """Copy this rank's slice of each ``(name, full tensor)`` into ``model``'s parameter ``name``."""
    params = dict(model.named_parameters())
    seen = set()
    for name, full in named_full:
        if name not in params:
            raise ValueError(f"tensor-parallel model has no parameter {name!r}")
        params[name].copy_(model.shard.tensor(name, full))
        seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"no weights for {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    return model.eval().requires_grad_(False)


def shard_model(full: nn.Module, comm: Collectives, device=None) -> nn.Module:
    """This rank's part of a model built by the caller (its device and dtype unless ``device``)."""
    w = full.embed_tokens.weight
    model = build_local(full.config, comm, device or w.device, w.dtype,
                        max_positions=getattr(full.rope, "max_positions", None))
    model.source_path = getattr(full, "source_path", None)
    return fill(model, full.named_parameters())


def _dummy_tensors(config: ModelConfig, dtype: torch.dtype, device, seed: int, std: float = 0.02):
    """The full model's dummy tensors, one at a time, as ``init_dummy_weights`` draws them."""
    shape_only = model_class(config.architecture)(config, device="meta", dtype=dtype)
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in shape_only.named_parameters():
        t = torch.empty(p.shape, dtype=p.dtype, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, std, generator=g)
        yield name, t


def load_shard(model_path, load_format: str, dtype, device, comm: Collectives, seed: int = 0,
               progress: bool = True) -> nn.Module:
    """:func:`doublesparse.models.load_model` for rank ``comm.rank`` of ``comm.size``."""
    fmt, path = resolve_model_path(model_path, load_format)
    if fmt != "dummy":
        # the dtype the model would get on its own device (bf16 on CUDA), not the CPU's default
        dt = dtype if dtype == "auto" else resolve_dtype(dtype, device)
        full = load_model(model_path, load_format=load_format, dtype=dt, device="cpu", progress=progress)
        return shard_model(full, comm, device=device)
    config = ModelConfig.from_json(path)
    dt = resolve_dtype(config.torch_dtype if dtype == "auto" else dtype, device)
    model = build_local(config, comm, device, dt)
    model.source_path = path
    return fill(model, _dummy_tensors(config, dt, device, seed))
