"""A cache of converted GGUF weights: a second load of the same GGUF skips parsing the file and
dequantizing its tensors (seconds of Python and numpy even for a 135M model).

After a GGUF is loaded, the model's parameters (in the dtype they were loaded in) and its
:class:`ModelConfig` go into one safetensors file under ``<cache dir>/weights/`` (the cache dir
of :func:`doublesparse.assets.cache_dir`). The file's name holds a key of the GGUF's resolved
path, size and modification time, the dtype and :data:`CACHE_FORMAT` (raised whenever the
conversion changes), so an edited or replaced GGUF, or a newer conversion, never reads a stale
entry. A later load with the same key maps that file instead (safetensors, memory-mapped and
copy-on-write: nothing is read until used, and the file is never written through).

An entry is used only if its header holds this format and dtype, a valid config, and exactly
the parameters of the model that config builds, with their shapes and dtype; anything else
(damaged, truncated, foreign) is ignored and rebuilt. Entries are written to a temporary file and renamed into place, so an
interrupted write leaves no entry; writing a new entry for a GGUF path removes that path's older
ones. GGUFs smaller than :data:`MIN_GGUF_BYTES` are not cached (they load faster than an entry is
written), nor models whose entry would exceed :data:`MAX_ENTRY_BYTES` of disk (an entry holds
the model in its load dtype, e.g. ~540 MB for SmolLM2-135M in float32). The folder may be
deleted at any time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from .config import ModelConfig

log = logging.getLogger("doublesparse.models")

CACHE_FORMAT = 1
MIN_GGUF_BYTES = 16 << 20
MAX_ENTRY_BYTES = 4 << 30


def _folder() -> Path:
    from ..assets import cache_dir

    return cache_dir() / "weights"


def entry_path(gguf: Path, dtype: torch.dtype) -> Path:
    """Where the converted weights of ``gguf`` in ``dtype`` live (whether or not they exist)."""
    src = gguf.resolve()
    st = src.stat()
    path_key = hashlib.sha256(str(src).encode()).hexdigest()[:12]
    key = hashlib.sha256(f"{st.st_size}|{st.st_mtime_ns}|{dtype}|{CACHE_FORMAT}".encode()).hexdigest()[:12]
    return _folder() / f"{src.stem}-{path_key}-{key}.safetensors"


def _state(model) -> dict[str, torch.Tensor]:
    """Parameters by name, each storage once (a tied lm_head is the embedding)."""
    return {n: p.detach() for n, p in model.named_parameters()}


def _config_json(config: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def load(gguf: Path, dtype: torch.dtype, build) -> torch.nn.Module | None:
    """The model from the cache entry of ``gguf`` in ``dtype``, or None when there is no usable
    entry. ``build(config)`` makes the uninitialised model whose parameters the
    entry fills: a CPU model takes the mapped tensors as they are, others get copies."""
    try:
        path = entry_path(gguf, dtype)
        if not path.is_file():
            return None
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        config = ModelConfig(**_config_dict(json.loads(meta["config"])))
        if meta.get("format") != str(CACHE_FORMAT) or meta.get("dtype") != str(dtype):
            return None
        tensors = load_file(str(path))
        model = build(config)
        params = _state(model)
        if set(tensors) != set(params) or any(
                tensors[n].shape != p.shape or tensors[n].dtype != p.dtype for n, p in params.items()):
            log.warning("ignoring the weight cache entry %s: it does not match the model", path)
            return None
        named = dict(model.named_parameters())
        for n, t in tensors.items():
            if named[n].device.type == "cpu":
                named[n].data = t
            else:
                named[n].data.copy_(t)
        return model
    except Exception as e:  # noqa: BLE001 - any cache problem: load from the GGUF instead
        log.warning("ignoring the weight cache entry for %s (%s)", gguf, e)
        return None


def _config_dict(d: dict) -> dict:
    d = dict(d)
    d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
    return d


def save(model, gguf: Path) -> Path | None:
    """Write ``model``'s parameters as the cache entry of ``gguf``; returns its path, or None when
    the GGUF is too small to be worth it, the entry too large, or the cache cannot be written
    (read-only home, full disk: the load itself has already succeeded)."""
    try:
        size = sum(t.numel() * t.element_size() for t in _state(model).values())
        if gguf.stat().st_size < MIN_GGUF_BYTES or size > MAX_ENTRY_BYTES:
            return None
        path = entry_path(gguf, model.dtype)
        meta = {"config": _config_json(model.config), "dtype": str(model.dtype),
                "format": str(CACHE_FORMAT), "source": str(gguf.resolve())}
        return _write_entry(path, {n: t.cpu().contiguous() for n, t in _state(model).items()}, meta)
    except Exception as e:  # noqa: BLE001 - the load itself has succeeded
        log.warning("could not write the weight cache for %s (%s)", gguf, e)
        return None


def _write_entry(path: Path, tensors: dict, meta: dict) -> Path:
    """Write ``tensors`` to ``path`` atomically (a temporary file renamed over it), then remove the
    entries of the same model under older keys (another dtype, torch version or format)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    prefix = path.name.rsplit("-", 1)[0] + "-"
    for old in path.parent.glob(f"{prefix}*.safetensors"):
        if old != path:
            old.unlink(missing_ok=True)
    return path


# ---------------------------------------------------------------------------------- packed copies
# The packed copies of the linear layers (models/packed.py) of a CPU model live in a file of their
# own under ``weights/packed/``, keyed like the entry above plus the torch version (the int4 layout
# is torch's): a second load maps them instead of re-quantizing every weight.

PACKED_FORMAT = 2


def packed_entry_path(gguf: Path, dtype: torch.dtype) -> Path:
    """Where the packed copies of ``gguf``'s model in ``dtype`` live (whether or not they exist)."""
    e = entry_path(gguf, dtype)
    key = hashlib.sha256(f"{e.name}|{torch.__version__}|{PACKED_FORMAT}".encode()).hexdigest()[:12]
    return e.parent / "packed" / f"{e.name.rsplit('-', 1)[0]}-{key}.safetensors"


def load_packed(model, gguf: Path) -> bool:
    """Attach the cached packed copies to ``model``'s Linear layers; False (nothing attached) when
    there is no usable entry."""
    from .layers import Linear
    from .packed import GROUP, INT4_ROW_BLOCK, PackedWeight

    try:
        path = packed_entry_path(gguf, model.dtype)
        if not path.is_file():
            return False
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), framework="pt") as f:
            kinds = json.loads((f.metadata() or {}).get("kinds", "null"))
        linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
        if not isinstance(kinds, dict) or set(kinds) != set(linears):
            return False
        tensors = load_file(str(path))
        copies = {}
        for n, m in linears.items():
            data, scales = tensors[f"{n}.data"], tensors[f"{n}.scales"]
            N, K = m.weight.shape
            N16 = N + (-N % INT4_ROW_BLOCK)
            want = ((N16, K // 2), torch.uint8, (K // GROUP, N16, 2)) if kinds[n] == "int4" else ((N, K), torch.bfloat16, (0,))
            if (tuple(data.shape), data.dtype, tuple(scales.shape)) != want or scales.dtype != torch.bfloat16:
                return False
            copies[n] = PackedWeight(kinds[n], data, scales, (N, K))
        for n, p in copies.items():
            linears[n].packed = p
        return True
    except Exception as e:  # noqa: BLE001 - any cache problem: pack again instead
        log.warning("ignoring the packed weight cache entry for %s (%s)", gguf, e)
        return False


def save_packed(model, gguf: Path) -> Path | None:
    """Write the packed copies of ``model``'s Linear layers as the packed entry of ``gguf``; None
    when the GGUF is too small to be worth it or the cache cannot be written."""
    from .layers import Linear

    try:
        if gguf.stat().st_size < MIN_GGUF_BYTES:
            return None
        linears = {n: m.packed for n, m in model.named_modules() if isinstance(m, Linear) and m.packed is not None}
        path = packed_entry_path(gguf, model.dtype)
        tensors = {}
        for n, p in linears.items():
            tensors[f"{n}.data"], tensors[f"{n}.scales"] = p.data.contiguous(), p.scales.contiguous()
        meta = {"kinds": json.dumps({n: p.kind for n, p in linears.items()}), "torch": torch.__version__,
                "format": str(PACKED_FORMAT), "source": str(gguf.resolve())}
        return _write_entry(path, tensors, meta)
    except Exception as e:  # noqa: BLE001 - the packing itself has succeeded
        log.warning("could not write the packed weight cache for %s (%s)", gguf, e)
        return None
