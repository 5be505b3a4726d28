"""Answering while the model loads.

``serve`` starts listening before the engine exists (loading a model takes seconds to minutes),
so that orchestrators and clients see a server that is coming up rather than a refused
connection: until the engine is built, on a thread of its own, ``/health`` answers 503 with
``status: "loading"`` and every other path 503 with code ``loading`` (and ``Retry-After``). Then
the real app takes every request, its lifespan started at that moment (the engine thread). A
failed load stops the server, and ``serve`` raises the load's error as the command's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any, Callable

from fastapi.responses import JSONResponse

from doublesparse.server.config import ServerConfig
from doublesparse.server.protocol import APIError

log = logging.getLogger("doublesparse.server")
RETRY_AFTER_S = 5


class LoadingApp:
    """ASGI app: the loading answers, then the app of ``create_app(build(), cfg)``.

    ``on_ready(app)`` runs once the real app has started; ``on_failure(exc)`` when ``build`` or
    the app's start failed (``error`` holds the exception). Both run on the event loop."""

    def __init__(self, build: Callable[[], Any], cfg: ServerConfig,
                 on_ready: Callable[[Any], None] | None = None,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.build, self.cfg = build, cfg
        self.on_ready, self.on_failure = on_ready, on_failure
        self.app = None                      # the real FastAPI app, once started
        self.error: BaseException | None = None
        self._stack = contextlib.AsyncExitStack()
        self._task: asyncio.Task | None = None

    @property
    def state(self):
        """The real app's ServerState; None while loading."""
        return None if self.app is None else self.app.state.server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._loading_answer(scope)(scope, receive, send)

    def _loading_answer(self, scope) -> JSONResponse:
        status = "failed" if self.error is not None else "loading"
        if scope["path"] == "/health":
            return JSONResponse({"status": status, "model": self.cfg.served_model_name},
                                status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        msg = ("the model failed to load; the server is stopping" if self.error is not None else
               "the model is still loading; retry when /health answers 200")
        return APIError(msg, status=503, type="server_error", code=status,
                        headers={"Retry-After": str(RETRY_AFTER_S)}).response()

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self._task = asyncio.get_running_loop().create_task(self._load())
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                if self._task is not None and not self._task.done():
                    self._task.cancel()  # stopped while loading: the build thread is a daemon
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._task
                await self._stack.aclose()   # the real app's shutdown: drains the engine thread
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _load(self) -> None:
        loop = asyncio.get_running_loop()
        built: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                res, err = self.build(), None
            except BaseException as e:  # reported by the event loop, raised by serve
                res, err = None, e
            with contextlib.suppress(RuntimeError):  # the loop closed: the server stopped
                loop.call_soon_threadsafe(_settle, built, res, err)

        threading.Thread(target=run, name="load-engine", daemon=True).start()
        try:
            engine = await built
            from doublesparse.server.app import create_app

            app = create_app(engine, self.cfg)
            await self._stack.enter_async_context(app.router.lifespan_context(app))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.error = e
            if self.on_failure is not None:
                self.on_failure(e)
            return
        self.app = app
        if self.on_ready is not None:
            self.on_ready(app)


def _settle(fut: asyncio.Future, res: Any, err: BaseException | None) -> None:
    if fut.done():
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(res)
