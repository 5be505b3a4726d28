"""Calibration on demand (``--ds-channel-config-path auto``): once per model, then from a cache.

The config is written under the user cache (``assets.cache_dir()/channels``), named by the model
file's sha256 and a hash of the calibration settings (text, samples, window, recall reference),
so a changed checkpoint or a changed procedure calibrates again and nothing else does. Hashing a
multi-GB checkpoint takes seconds to minutes, so each file's hash is itself cached, keyed by its
path, size and modification time. A model handed to the engine in memory (no file) is keyed by a
hash of its weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from ..assets import cache_dir
from ..channels import FORMAT_VERSION, save_config
from .frontier import DECODE_LEN, RULE, OpSettings
from .pipeline import RECALL, RECALL_SAMPLES, STATISTIC, build_config
from .recall import CANDIDATES
from ..texts import CALIBRATION_PLAYS, read_texts, text_hash

log = logging.getLogger("doublesparse.calibrate")
NUM_SAMPLES, SEQ_LEN = 12, 2048  # as `doublesparse calibrate`'s defaults (the packaged configs')
_WEIGHT_FILES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
_CHUNK = 1 << 22


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, streamed; remembered in the cache by (path, size, mtime)."""
    p = Path(path).resolve()
    st = p.stat()
    memo_path = cache_dir() / "file-sha256.json"
    try:
        memo = json.loads(memo_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        memo = {}
    hit = memo.get(str(p))
    if hit and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
        return hit["sha256"]
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    memo[str(p)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": h.hexdigest()}
    _write_atomic(memo_path, json.dumps(memo, indent=1, sort_keys=True))
    return h.hexdigest()


def model_sha256(model_file: str | Path | None, model=None) -> str:
    """sha256 of the checkpoint: a file's own hash; a folder's over its weight files and
    config.json (names and hashes); no file: the weights' bytes in parameter order."""
    h = hashlib.sha256()
    if model_file is not None and Path(model_file).is_file():
        return file_sha256(model_file)
    if model_file is not None and Path(model_file).is_dir():
        root = Path(model_file)
        files = sorted(f for f in root.rglob("*") if f.is_file()
                       and (f.suffix in _WEIGHT_FILES or f.name == "config.json"))
        if not files:
            raise ValueError(f"{root}: no weight files to key the calibration cache by")
        for f in files:
            h.update(f"{f.relative_to(root).as_posix()}\0{file_sha256(f)}\n".encode())
        return h.hexdigest()
    if model is None:
        raise ValueError("calibration on demand needs the model file or the model")
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def settings_hash(texts: list[str], num_samples: int, seq_len: int, op: OpSettings | None = None) -> str:
    """What the calibration's result depends on besides the model."""
    s = json.dumps({"text": text_hash(texts), "num_samples": num_samples, "seq_len": seq_len,
                    "statistic": STATISTIC, "recall": RECALL, "recall_samples": RECALL_SAMPLES,
                    "candidates": list(CANDIDATES), "format": FORMAT_VERSION,
                    "operating_point": dict((op or OpSettings()).key(), rule=RULE)}, sort_keys=True)
    return hashlib.sha256(s.encode()).hexdigest()[:8]


def ensure_config(model, tokenizer, model_file: str | Path | None, progress: bool = True,
                  texts: list[str] | None = None) -> Path:
    """Path of the cached calibrated config for ``model``, calibrating it first if needed (on the
    model's device, on the packaged calibration plays unless ``texts`` are given)."""
    if tokenizer is None:
        raise ValueError("--ds-channel-config-path auto calibrates on text and needs the model's "
                         "tokenizer; this model has none")
    given = texts is not None
    texts = texts if given else read_texts(None)
    c = model.config
    seq_len = min(SEQ_LEN, int(c.max_position_embeddings))
    key = model_sha256(model_file, model)
    device = next(model.parameters()).device
    # the measured length depends on the device: part of the cache key
    n = OpSettings().length(device, int(c.max_position_embeddings))
    op = OpSettings(seq_len=n, decode_len=min(DECODE_LEN, max(2, n // 2)))
    path = cache_dir() / "channels" / f"{key[:16]}-{settings_hash(texts, NUM_SAMPLES, seq_len, op)}.json"
    if path.is_file():
        log.info("channel config: calibrated earlier, %s", path)
        return path
    log.warning("channel config: calibrating %s once on the packaged text (%d x %d tokens); the "
                "result is cached at %s", getattr(c, "name", "the model"), NUM_SAMPLES, seq_len, path)
    meta = {"texts": "given" if given else list(CALIBRATION_PLAYS),
            "model_file": str(model_file) if model_file else None, "model_sha256": key,
            "command": "--ds-channel-config-path auto", "device": str(device)}
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        cfg = build_config(model, tokenizer, texts, NUM_SAMPLES, seq_len, device, progress=progress, meta=meta,
                           op=op)
    finally:
        model.train(was_training)
        if device.type == "cuda":  # the engine sized its KV pool before: hand the activations back
            torch.cuda.empty_cache()
    tmp = save_config(cfg, path.with_name(path.name + f".{os.getpid()}.tmp"))
    os.replace(tmp, path)  # another process calibrating the same model writes the same content
    return path


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
