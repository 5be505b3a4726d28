"""What the routes share: the engine, its worker thread, metrics, the tokenizer pool, and
facts about the served model read once at startup."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from doublesparse.server.admission import Admission
from doublesparse.server.config import ServerConfig
from doublesparse.server.metrics import ServerMetrics
from doublesparse.server.tools import repair_chat_template
from doublesparse.server.worker import EngineWorker

DS_FIELDS = ("enable_double_sparsity", "ds_heavy_token_num")
log = logging.getLogger("doublesparse.server")


class ServerState:
    """Everything the routes share. Created once per app."""

    def __init__(self, engine: Any, cfg: ServerConfig) -> None:
        self.engine, self.cfg = engine, cfg
        self.worker = EngineWorker(engine)
        self.metrics = ServerMetrics(self.worker)
        self.tokenizer = engine.tokenizer
        if repair_chat_template(self.tokenizer):
            log.info("chat template: restored the single braces of its tool-call example "
                     "(Qwen2.5-Coder's template doubles them, and the model copies them)")
        # One tokenizer thread: keeps chat templating and encoding off both the event loop and
        # the engine thread, and serialises access (HF fast tokenizers dislike concurrent use).
        self.tok_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.model_name = cfg.served_model_name or default_model_name(engine)
        self.max_context = int(getattr(engine, "max_context_len", 0) or 0) or None
        self.ds_supported = engine_supports_ds(engine)
        self.sampling_fields = engine_sampling_fields(engine)
        self.vocab_size = vocab_size(engine)
        self.draining = False
        self.admission = Admission(cfg.max_choices_per_request, cfg.max_requests_per_client)
        # siblings of one fan-out in the engine at once: enough to fill its batch twice over
        running = getattr(getattr(engine, "config", None), "max_running_requests", None) \
            or getattr(engine, "max_running", None) or 64
        self.fanout_window = max(256, 2 * int(running))

    async def tokenize(self, fn, *args) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self.tok_pool, fn, *args)


def default_model_name(engine: Any) -> str:
    """A stable, space-free id: the checkpoint's file/dir name (GGUF metadata names are prose)."""
    if isinstance(getattr(engine, "model_name", None), str):
        return engine.model_name
    cfg = getattr(engine, "config", None)
    if cfg is not None and hasattr(cfg, "model_path"):
        if cfg.model_path:
            base = str(cfg.model_path).rstrip("/").rsplit("/", 1)[-1]
            return base[:-5] if base.endswith(".gguf") else base
        from doublesparse.assets import SMOLLM2_FILE  # the embedded default model
        return SMOLLM2_FILE.split(".")[0]
    name = getattr(getattr(engine, "model_config", None), "name", None)
    return name.replace(" ", "-") if isinstance(name, str) and name else "doublesparse-model"


def engine_sampling_fields(engine: Any) -> frozenset[str]:
    """The fields of the engine's SamplingParams: what a request may ask of it."""
    cls = getattr(engine, "sampling_params_cls", None)
    if cls is None:
        try:
            from doublesparse.engine.sampling_params import SamplingParams as cls
        except Exception:
            return frozenset()
    if dataclasses.is_dataclass(cls):
        return frozenset(f.name for f in dataclasses.fields(cls))
    return frozenset(getattr(cls, "model_fields", {}) or getattr(cls, "__annotations__", {}))


def engine_supports_ds(engine: Any) -> bool:
    """Per-request DS overrides are honoured only if the engine's SamplingParams carries them."""
    names = engine_sampling_fields(engine)
    return all(f in names for f in DS_FIELDS)


def vocab_size(engine: Any) -> int | None:
    for obj, attr in ((getattr(engine, "model_config", None), "vocab_size"),
                      (engine.tokenizer, "vocab_size")):
        v = getattr(obj, attr, None) if obj is not None else None
        if isinstance(v, int) and v > 0:
            return v
    return None
