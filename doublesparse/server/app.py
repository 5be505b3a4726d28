"""FastAPI application: OpenAI-compatible and SGLang-native generation endpoints."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from doublesparse.server.config import ServerConfig
from doublesparse.server.fields import IGNORED_HEADER
from doublesparse.server.http import new_id
from doublesparse.server.metrics import stat
from doublesparse.server.protocol import APIError
from doublesparse.server.routes import register_generation_routes
from doublesparse.server.state import ServerState

OPEN_PATHS = {"/health"}  # liveness probes work without the key
log = logging.getLogger("doublesparse.server")


def request_id(request: Request) -> str:
    """The id a route gave the request (its response id), else a new one for the log."""
    state = request.scope.setdefault("state", {})
    if "request_id" not in state:
        state["request_id"] = new_id("req")
    return state["request_id"]


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
    async def _api_error(request: Request, e: APIError):
        st.metrics.rejected.labels(str(e.status)).inc()
        if e.status < 500:
            return e.response()
        rid = request_id(request)  # every 5xx leaves a line naming its request
        log.error("request %s: %s %s -> %d %s: %s", rid, request.method, request.url.path,
                  e.status, e.code or e.type, e.message)
        return e.response({"X-Request-Id": rid})

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        st.metrics.rejected.labels("500").inc()
        rid = request_id(request)
        # (Starlette re-raises it after this answer, so the server logs the traceback once)
        log.error("request %s: %s %s -> 500: %s: %s", rid, request.method, request.url.path,
                  type(e).__name__, e)
        return APIError(f"internal error ({type(e).__name__}); request id {rid}", status=500,
                        type="server_error").response({"X-Request-Id": rid})

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
                "kv_total_tokens": stat(s, "kv_total"), "kv_cache_dtype": s.get("kv_cache_dtype"),
                "in_flight": st.worker.in_flight}
        if "double_sparsity" in s:
            body["decode"] = {"double_sparsity": bool(s["double_sparsity"]),
                              "policy": s.get("decode_policy"),
                              "heavy_token_num": s.get("heavy_token_num"),
                              "heavy_channel_num": s.get("heavy_channel_num"),
                              "channel_source": s.get("channel_source"),
                              "channels_calibrated": s.get("channels_calibrated"),
                              "operating_point": s.get("operating_point")}
            r = s.get("attention_recall")
            if r:
                body["decode"]["attention_recall"] = {
                    k: r.get(k) for k in ("sample_interval", "sampled_steps", "samples", "recall_mean",
                                          "recall_min", "rel_error_mean")}
                body["decode"]["attention_recall"]["layer_groups"] = {
                    g["layers"]: (g["sum"] / g["count"] if g["count"] else None) for g in r["groups"]}
            b = s.get("budget_scale")
            if b:
                body["decode"]["budget_scale"] = {
                    "target_recall": b["target_recall"], "changes": b["changes"],
                    "k_min": b["k_min"], "k_lo": b["k_lo"], "k_max": b["k_max"], "scales": b["scales"],
                    "layer_groups": {g["layers"]: g["scale"] for g in b["groups"]}}
        if not st.worker.alive:
            body["status"] = "engine_dead"
            if st.worker.fatal is not None:  # e.g. a tensor-parallel rank that exited
                body["error"] = str(st.worker.fatal)
        elif st.draining:
            body["status"] = "draining"
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/flush_cache")
    async def flush_cache():
        """Drop the cached prefixes no running request holds (SGLang's route)."""
        if not hasattr(engine, "flush_cache"):
            return {"flushed_tokens": 0}
        n, snap = await st.worker.call(lambda eng: (eng.flush_cache(), eng.stats()))
        st.worker.snapshot = dict(snap)  # /health and /metrics show the freed slots at once
        return {"flushed_tokens": int(n)}

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

    register_generation_routes(app, st)
    return app


class FrontDoor:
    """Pure ASGI middleware: stamps the arrival time (TTFT counts from here), checks the API
    key before any routing or body reading, and adds the ``X-Ignored-Fields`` header to the
    response of a request whose route noted ignored fields (:mod:`doublesparse.server.fields`).
    Pure ASGI rather than ``@app.middleware`` because the latter re-wraps every streamed chunk,
    which costs per-token overhead under load."""

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
            if scope["method"] == "POST":
                send = _with_ignored_header(scope, send)
        await self.app(scope, receive, send)


def _with_ignored_header(scope, send):
    """``send`` that adds the header a route left in the scope to the response's start."""
    async def wrapped(message):
        if message["type"] == "http.response.start":
            value = scope["state"].get("ignored_fields")
            if value:
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (IGNORED_HEADER.lower().encode(),
                                                   value.encode("latin-1"))]}
        await send(message)
    return wrapped
