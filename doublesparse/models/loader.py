"""Public entry points: ``load_model`` and ``load_tokenizer``.

``model_path`` may be ``None`` (the embedded SmolLM2-135M-Instruct GGUF), a Hugging Face folder
(config.json + safetensors), a ``.gguf`` file or a folder holding one, the name of a fetched model
(``doublesparse fetch qwen2.5-coder-1.5b``), or, with
``load_format="dummy"``, anything that yields a config.json (folder, file, or the name of a config
shipped in ``doublesparse/configs/models``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .config import ModelConfig
from .registry import model_class
from .weights import (check_gguf_magic, gguf_config, init_dummy_weights, load_gguf_weights,
                      load_safetensors_weights)
from .weights import open_gguf as _read_gguf

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs" / "models"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def shipped_configs() -> list[str]:
    """Names accepted by ``load_model(name, load_format="dummy")``, e.g. ``"llama-3.1-8b"``."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def default_model_path() -> Path:
    from ..assets import smollm2_gguf_path

    return smollm2_gguf_path()


def open_gguf(path: Path):
    """:func:`.weights.open_gguf`, its errors saying what to do about a damaged file."""
    try:
        return _read_gguf(path)
    except ValueError as e:  # truncated download, disk error, or not a GGUF at all
        raise ValueError(f"{e}; copy or download the file again") from e


def resolve_dtype(dtype, device) -> torch.dtype:
    """None -> bf16 on CUDA, float32 elsewhere; strings like ``"bfloat16"`` are accepted."""
    if dtype is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, str):
        d = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(d, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        return d
    return dtype


def _single_gguf(folder: Path) -> Path | None:
    files = sorted(folder.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{folder} holds several GGUF files ({', '.join(f.name for f in files)}); pass one")
    return files[0] if files else None


def _dummy_config_path(model_path: str | Path) -> Path:
    p = Path(model_path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} has no config.json (needed for load_format='dummy')")
        return p / "config.json"
    if p.is_file():
        return p
    shipped = CONFIGS_DIR / f"{model_path}.json"
    if shipped.is_file():
        return shipped
    raise FileNotFoundError(f"no config for dummy model {str(model_path)!r}: not a folder with config.json, "
                            f"not a JSON file, and not a shipped config ({', '.join(shipped_configs())})")


def _local_path(model_path: str | Path) -> Path:
    """``model_path`` as a path; a fetchable model's name (``doublesparse fetch --list``) that is not
    also an existing path resolves to its fetched file, or raises naming the fetch command."""
    from ..assets import named_model_path

    p = Path(model_path).expanduser()
    if not p.exists():
        return named_model_path(str(model_path)) or p
    return p


def resolve_model_path(model_path: str | Path | None, load_format: str = "auto") -> tuple[str, Path]:
    """-> (format, path): ``("safetensors", folder)``, ``("gguf", file)`` or ``("dummy", config.json)``."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {', '.join(LOAD_FORMATS)}")
    if model_path is None:
        if load_format not in ("auto", "gguf"):
            raise ValueError(f"load_format={load_format!r} needs a model_path")
        return "gguf", default_model_path()
    if load_format == "dummy":
        return "dummy", _dummy_config_path(model_path)
    p = _local_path(model_path)
    if not p.exists():
        hint = (" (it is a shipped config: use load_format='dummy' for random weights)"
                if (CONFIGS_DIR / f"{model_path}.json").is_file() else "")
        raise FileNotFoundError(f"model path {str(p)!r} does not exist{hint}")
    if p.is_file():
        if p.suffix == ".safetensors" or load_format == "safetensors":
            raise ValueError(f"{p} is a single file; safetensors weights are read from their folder "
                             f"(config.json, *.safetensors, tokenizer files): pass the folder {p.parent}")
        if p.suffix in (".bin", ".pt", ".pth", ".ckpt"):
            raise ValueError(f"{p}: PyTorch pickle checkpoints are not read; use the model's safetensors "
                             f"folder or a .gguf file")
        return "gguf", p  # open_gguf checks the magic and says so if it is something else
    has_st = (p / "config.json").is_file() and (any(p.glob("*.safetensors"))
                                                or (p / "model.safetensors.index.json").is_file())
    if load_format in ("auto", "safetensors") and has_st:
        return "safetensors", p
    if load_format in ("auto", "gguf"):
        g = _single_gguf(p)
        if g is not None:
            return "gguf", g
    what = {"auto": "config.json + *.safetensors or a *.gguf", "safetensors": "config.json + *.safetensors",
            "gguf": "a *.gguf file"}[load_format]
    extra = " (use load_format='dummy' for random weights)" if (p / "config.json").is_file() else ""
    raise ValueError(f"{p} holds no model weights: expected {what}{extra}")


def load_config(model_path: str | Path | None, load_format: str = "auto") -> ModelConfig:
    """The :class:`ModelConfig` ``load_model`` would use, without touching the weights."""
    fmt, path = resolve_model_path(model_path, load_format)
    if fmt == "gguf":
        return gguf_config(open_gguf(path))
    return ModelConfig.from_json(path / "config.json" if fmt == "safetensors" else path)


def _load_cached_gguf(path: Path, dtype, device, max_positions):
    """The model from the converted-weights cache (models/weight_cache.py), or None."""
    from . import weight_cache as wc

    dt = resolve_dtype(dtype, device)
    model = wc.load(path, dt, lambda c: model_class(c.architecture)(c, device=device, dtype=dt,
                                                                   max_positions=max_positions))
    if model is None:
        return None
    model.source_path = path
    return model.eval().requires_grad_(False)


def load_model(model_path: str | Path | None, load_format: str = "auto", dtype=None, device="cpu",
               progress: bool = True, seed: int = 0, max_positions: int | None = None,
               weight_cache: bool = True, packed: bool = False):
    """Build a model with weights on ``device`` in ``dtype`` (default bf16 on CUDA, float32 on CPU;
    ``"auto"`` = the checkpoint's ``torch_dtype``).

    ``load_format``: ``"auto"`` (detect), ``"safetensors"``, ``"gguf"`` or ``"dummy"`` (seeded random
    weights, std 0.02, unit norms). ``max_positions`` caps the RoPE table (default: the config's
    ``max_position_embeddings``). Returns the architecture's model class from the registry, in eval
    mode. Raises ``FileNotFoundError`` / ``ValueError`` naming the offending path or tensor.
    ``weight_cache``: keep a GGUF's converted weights in the cache and load them from there the
    next time (:mod:`.weight_cache`). ``packed`` (CPU): give the linear layers weight-only packed
    copies for decode (:mod:`.packed`), a GGUF's kept in the cache too.
    """

    fmt, path = resolve_model_path(model_path, load_format)
    reader = None
    if fmt == "gguf" and weight_cache and dtype != "auto":
        model = _load_cached_gguf(path, dtype, device, max_positions)
        if model is not None:
            return _with_packed(model, path, packed)
    if fmt == "gguf":
        reader = open_gguf(path)
        config = gguf_config(reader)
    else:
        config = ModelConfig.from_json(path / "config.json" if fmt == "safetensors" else path)
    dtype = resolve_dtype(config.torch_dtype if dtype == "auto" else dtype, device)
    model = model_class(config.architecture)(config, device=device, dtype=dtype, max_positions=max_positions)
    if fmt == "gguf":
        load_gguf_weights(model, reader, path, progress=progress)
        if weight_cache:
            from . import weight_cache as wc
            wc.save(model, path)
    elif fmt == "safetensors":
        load_safetensors_weights(model, path, progress=progress)
    else:
        init_dummy_weights(model, seed=seed)
    model.source_path = path
    model = model.eval().requires_grad_(False)
    return _with_packed(model, path if fmt == "gguf" and weight_cache else None, packed)


def _with_packed(model, gguf: Path | None, packed: bool):
    """``model``, its CPU Linear layers given packed copies when ``packed``: from the cache entry
    of ``gguf`` when there is one, else packed now (and cached for ``gguf``)."""
    if not packed or next(model.parameters()).device.type != "cpu":
        return model
    from . import weight_cache as wc
    from .packed import pack_linears

    if gguf is not None and wc.load_packed(model, gguf):
        return model
    pack_linears(model)
    if gguf is not None:
        wc.save_packed(model, gguf)
    return model


def load_tokenizer(model_path: str | Path | None):
    """transformers tokenizer for a model folder or GGUF, read offline; ``None`` when there is none.

    Dummy models (a bare config.json / shipped config name) and folders without tokenizer files
    give ``None``: callers must then feed token ids. The chat template, when the tokenizer has one,
    is ``tokenizer.chat_template`` (SmolLM2's GGUF carries it).
    """
    from transformers import AutoTokenizer

    p = default_model_path() if model_path is None else _local_path(model_path)
    if not p.exists():
        if (CONFIGS_DIR / f"{model_path}.json").is_file():
            return None
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    gguf_file = p if p.suffix == ".gguf" else None
    if p.is_dir():
        if any((p / f).is_file() for f in _TOKENIZER_FILES):
            return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        gguf_file = _single_gguf(p)
    if gguf_file is None:
        return None
    check_gguf_magic(gguf_file)  # a clear error for non-GGUF files before transformers tries
    return _gguf_tokenizer_cached(gguf_file)


_PROBE = "Hello, world! To be, or not to be: 12345 \u00e9t\u00e9\n<|im_start|>user"


def _gguf_tokenizer_cached(gguf_file: Path):
    """Building a tokenizer from a GGUF parses its whole vocabulary in Python (seconds, in every
    command), so the first build is saved as a tokenizer folder in the cache (keyed by the file's
    path, size and mtime) and later loads read that folder instead. The saved copy
    is used only if it encodes a probe string and renders the chat template exactly as the
    GGUF-built one did; any cache problem falls back to the GGUF."""
    import hashlib

    from transformers import AutoTokenizer

    from ..assets import cache_dir

    st = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_dir() / "tokenizers" / f"{gguf_file.stem}-{key}"
    damaged = False
    if (folder / "ok").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception:  # a damaged cache entry: rebuild from the GGUF below
            damaged = True
    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, local_files_only=True)
    tmp = None
    try:
        # written and verified in a private folder, then renamed into place: a process loading
        # the same GGUF meanwhile never reads a half-written entry
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".tmp"))
        tok.save_pretrained(str(tmp))
        copy = AutoTokenizer.from_pretrained(str(tmp), local_files_only=True)
        if _fingerprint(copy) == _fingerprint(tok):
            (tmp / "ok").write_text("verified against the GGUF tokenizer\n")
            if damaged or (folder.is_dir() and not (folder / "ok").is_file()):
                shutil.rmtree(folder, ignore_errors=True)
            os.rename(tmp, folder)  # fails if another process has put its entry there first
    except Exception:  # read-only home, full disk, an entry already there: use the GGUF-built one
        pass
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


def _fingerprint(tok) -> tuple:
    msgs = [{"role": "user", "content": "hi"}]
    tmpl = None
    if getattr(tok, "chat_template", None):
        tmpl = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return (tuple(tok.encode(_PROBE)), tok.eos_token_id, tok.bos_token_id, tmpl, len(tok))


def read_chat_template(model_path: str | Path | None) -> str | None:
    """The chat template (Jinja source) without building a tokenizer, or ``None`` if there is none."""
    p = default_model_path() if model_path is None else _local_path(model_path)
    if p.is_dir():
        if (p / "chat_template.jinja").is_file():
            return (p / "chat_template.jinja").read_text()
        tc = p / "tokenizer_config.json"
        if tc.is_file():
            t = json.loads(tc.read_text()).get("chat_template")
            return t if isinstance(t, str) else None
        p = _single_gguf(p) or p
    if p.is_file() and p.suffix == ".gguf":
        f = open_gguf(p).fields.get("tokenizer.chat_template")
        return None if f is None else f.contents()
    return None
