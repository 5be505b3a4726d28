"""The per-layer scales of an fp8 K/V cache (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``).

A pool stores ``clamp(x / scale, +-max)`` in fp8 and its readers use ``value * scale``, one scale
per layer for K and one for V (``KVMemory.k_scale`` / ``v_scale``, [1] float32 device tensors
that the kernels read on the device). Where they come from, first found wins:

1. ``--kv-cache-scales-path``: JSON ``{"k_scale": x | [x per layer], "v_scale": ...}``;
2. the checkpoint's own scales, as fp8 checkpoints quantized for vLLM / SGLang carry them:
   safetensors tensors ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (scalars or one
   value); the loaders skip them otherwise. GGUF files have no such tensors;
3. 1.0 (vLLM's and SGLang's default): exact for the format's range, e4m3 holds |x| <= 448 at 3
   mantissa bits, e5m2 |x| <= 57344 at 2; larger values are clamped, not turned into inf.

No calibrated default: a scale only moves the range. Relative precision is the format's anywhere
in its normal range (down to 2^-6 x scale for e4m3), and on SmolLM2-135M per-layer or per-head
scales from calibration text did not lower the error at all (docs/accuracy.md, fp8 KV cache):
almost all of it is K's 3-bit rounding, which the q/K rotation (attention/k_rotation.py) reduces.
That rotation is on by default only with source 3, since sources 1 and 2 were measured on
unrotated K.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

DEFAULT_SCALE = 1.0
DEFAULT_SOURCE = f"default {DEFAULT_SCALE}"   # resolve_scales' source for the default


def _per_layer(value, name: str, num_layers: int, source: str) -> list[float]:
    vals = value if isinstance(value, list) else [value] * num_layers
    if len(vals) != num_layers:
        raise ValueError(f"{source}: {name} has {len(vals)} values for {num_layers} layers")
    out = []
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{source}: {name} values must be positive finite numbers, got {v!r}")
        out.append(float(v))
    return out


def read_scales_file(path: str, num_layers: int) -> tuple[list[float], list[float]]:
    """(k scales, v scales) per layer from a JSON file (see the module docstring)."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"kv_cache_scales_path {path}: {e}") from e
    if not isinstance(raw, dict) or "k_scale" not in raw or "v_scale" not in raw:
        raise ValueError(f"kv_cache_scales_path {path}: expected a JSON object with k_scale and v_scale")
    src = f"kv_cache_scales_path {path}"
    return (_per_layer(raw["k_scale"], "k_scale", num_layers, src),
            _per_layer(raw["v_scale"], "v_scale", num_layers, src))


def checkpoint_scales(model_file: str | None, num_layers: int) -> tuple[list[float], list[float]] | None:
    """The checkpoint's ``self_attn.k_scale`` / ``v_scale`` of every layer (safetensors folders
    only), or None where it has none (any layer missing: None)."""
    if not model_file or not Path(model_file).is_dir():
        return None
    files = sorted(Path(model_file).glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open
    found: dict[str, float] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            for name in h.keys():
                if name.endswith(("self_attn.k_scale", "self_attn.v_scale")):
                    found[name] = float(h.get_tensor(name).float().reshape(-1)[0])
    k = [found.get(f"model.layers.{i}.self_attn.k_scale") for i in range(num_layers)]
    v = [found.get(f"model.layers.{i}.self_attn.v_scale") for i in range(num_layers)]
    if any(x is None for x in k + v):
        return None
    src = f"checkpoint {model_file}"
    return _per_layer(k, "k_scale", num_layers, src), _per_layer(v, "v_scale", num_layers, src)


def resolve_scales(cfg, model_file: str | None, num_layers: int) -> tuple[list[float], list[float], str]:
    """(k scales, v scales, where they came from) of an fp8 cache, per layer."""
    if cfg.kv_cache_scales_path:
        return (*read_scales_file(cfg.kv_cache_scales_path, num_layers), cfg.kv_cache_scales_path)
    found = checkpoint_scales(model_file, num_layers)
    if found is not None:
        return (*found, f"checkpoint {model_file}")
    ones = [DEFAULT_SCALE] * num_layers
    return ones, list(ones), DEFAULT_SOURCE


def apply_scales(memory, k: list[float], v: list[float]) -> None:
    """Fill the memory's per-layer scale tensors in place (before any CUDA graph is captured)."""
    for i, (ks, vs) in enumerate(zip(k, v)):
        memory.k_scale[i].fill_(ks)
        if memory.v_scale is not memory.k_scale:
            memory.v_scale[i].fill_(vs)
