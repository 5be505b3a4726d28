"""FastAPI application: OpenAI-compatible and SGLang-native generation endpoints."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from doublesparse.server.config import ServerConfig
from doublesparse.server.generation import Generation
from doublesparse.server.metrics import ServerMetrics, stat
from doublesparse.server.protocol import APIError
from doublesparse.server.worker import EngineWorker

OPEN_PATHS = {"/health"}  # liveness probes work without the key
DS_FIELDS = ("enable_double_sparsity", "ds_heavy_token_num")


class ServerState:
    """Everything the routes share. Created once per app."""

    def __init__(self, engine: Any, cfg: ServerConfig) -> None:
        self.engine, self.cfg = engine, cfg
        self.worker = EngineWorker(engine)
        self.metrics = ServerMetrics(self.worker)
        self.tokenizer = engine.tokenizer
        # One tokenizer thread: keeps chat templating and encoding off both the event loop and
        # the engine thread, and serialises access (HF fast tokenizers dislike concurrent use).
        self.tok_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.model_name = cfg.served_model_name or default_model_name(engine)
        self.max_context = int(getattr(engine, "max_context_len", 0) or 0) or None
        self.ds_supported = engine_supports_ds(engine)
        self.vocab_size = vocab_size(engine)
        self.draining = False

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


def engine_supports_ds(engine: Any) -> bool:
    """Per-request DS overrides are honoured only if the engine's SamplingParams carries them."""
    cls = getattr(engine, "sampling_params_cls", None)
    if cls is None:
        try:
            from doublesparse.engine.sampling_params import SamplingParams as cls
        except Exception:
            return False
    if dataclasses.is_dataclass(cls):
        names = {f.name for f in dataclasses.fields(cls)}
    else:
        names = set(getattr(cls, "model_fields", {}) or getattr(cls, "__annotations__", {}))
    return all(f in names for f in DS_FIELDS)


def vocab_size(engine: Any) -> int | None:
    for obj, attr in ((getattr(engine, "model_config", None), "vocab_size"),
                      (engine.tokenizer, "vocab_size")):
        v = getattr(obj, attr, None) if obj is not None else None
        if isinstance(v, int) and v > 0:
            return v
    return None


def create_app(engine: Any, cfg: ServerConfig = ServerConfig()) -> FastAPI:
    st = ServerState(engine, cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        st.worker.start()
        try:
            yield
        finally:  # uvicorn reaches this only after in-flight requests finished (SIGTERM drain)
            st.draining = True
            await asyncio.get_running_loop().run_in_executor(None, st.worker.shutdown)
            st.tok_pool.shutdown(wait=False)

    app = FastAPI(title="doublesparse", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = st

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        st.metrics.rejected.labels(str(e.status)).inc()
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return APIError(str(e.detail), status=e.status_code, type=kind).response()

    app.add_middleware(FrontDoor, api_key=cfg.api_key)

    @app.get("/health")
    async def health():
        s = st.worker.snapshot
        body = {"status": "ok", "model": st.model_name, "running": stat(s, "running"),
                "waiting": stat(s, "waiting"), "kv_used_tokens": stat(s, "kv_used"),
                "kv_total_tokens": stat(s, "kv_total"), "in_flight": st.worker.in_flight}
        if not st.worker.alive:
            body["status"] = "engine_dead"
        elif st.draining:
            body["status"] = "draining"
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": st.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "doublesparse", "max_model_len": st.max_context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != st.model_name:
            raise APIError(f"the model '{model_id}' does not exist", status=404, param="model",
                           code="model_not_found")
        return model_card()

    from doublesparse.server.routes import register_generation_routes
    register_generation_routes(app, st)
    return app


class FrontDoor:
    """Pure ASGI middleware: stamps the arrival time (TTFT counts from here) and checks the API
    key before any routing or body reading. Pure ASGI rather than ``@app.middleware`` because
    the latter re-wraps every streamed chunk, which costs per-token overhead under load."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app, self.key = app, (api_key or "").encode() or None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {})["t_arrival"] = time.perf_counter()
            if self.key is not None and scope["path"] not in OPEN_PATHS:
                got = dict(scope.get("headers") or ()).get(b"authorization", b"")
                token = got[7:].strip() if got[:7].lower() == b"bearer " else b""
                if not hmac.compare_digest(token, self.key):
                    err = APIError("invalid or missing API key (send 'Authorization: Bearer KEY')",
                                   status=401, code="invalid_api_key")
                    await err.response()(scope, receive, send)
                    return
        await self.app(scope, receive, send)


async def read_body(request: Request, limit: int) -> bytes:
    """Read at most ``limit`` bytes; refuse early on Content-Length and while streaming."""
    try:
        declared = int(request.headers.get("content-length", "0"))
    except ValueError:
        raise APIError("invalid Content-Length header") from None
    too_big = APIError(f"request body exceeds the {limit}-byte limit", status=413,
                       code="request_too_large")
    if declared > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def stream_response(gen) -> StreamingResponse:
    # X-Accel-Buffering: proxies must not hold back tokens.
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def make_generation(st: ServerState, endpoint: str, rid: str, ids: list[int], sp: dict,
                    request: Request) -> Generation:
    return Generation(st.worker, st.metrics, endpoint, rid, ids, sp, request)
