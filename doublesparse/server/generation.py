"""One request's journey through the engine thread, as seen from the event loop.

``Generation`` submits a tokenized prompt, relays events, records metrics, and guarantees the
engine forgets the request when the client goes away: a watcher on the ASGI receive channel
aborts on ``http.disconnect`` (this also covers requests still waiting for KV slots, which
produce no output that a failed send could reveal), and leaving the iterator early aborts too.
A fanned-out request's siblings share one watcher instead (:mod:`doublesparse.server.choices`).

``rid`` is the engine's id, always made by the server: a client's own ``rid`` is only a label
(:mod:`doublesparse.server.admission`), so no client can name another's request.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request

from doublesparse.server.http import client_message
from doublesparse.server.protocol import APIError
from doublesparse.server.worker import ACCEPTED, EngineWorker, Finished

SHUTDOWN = "shutdown"  # finish reason of requests cut at the graceful-shutdown deadline


class Generation:
    def __init__(self, worker: EngineWorker, metrics, endpoint: str, rid: str,
                 prompt_ids: list[int], sampling_params: dict, request: Request | None,
                 watch: bool = True, group: str | None = None) -> None:
        self.worker, self.metrics, self.endpoint, self.rid = worker, metrics, endpoint, rid
        self.group = group                   # fair-admission group: the client request's id
        self.prompt_ids, self.sp, self.request = prompt_ids, sampling_params, request
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.text = ""
        self.token_ids: list[int] = []       # every generated token id
        self.token_logprobs: list = []       # per token, when logprobs were asked for
        self.prompt_logprobs: list | None = None  # per prompt token (None first), when asked for
        self.ds_stats: dict | None = None    # the finished request's, when it asked (return_ds_stats)
        self.watch = watch                   # False: the caller watches for the disconnect
        self.disconnected = False
        self._pending: list[Any] = []
        self._handle = None
        self._watch: asyncio.Task | None = None
        # Latencies count from arrival at the server (stamped by FrontDoor), so they include body
        # reading and tokenization as a client would see them.
        state = request.scope.get("state") if request is not None else None
        self._t0 = (state or {}).get("t_arrival") or time.perf_counter()
        self._t_first: float | None = None
        self._done = False
        self._started = False
        self._submitted = asyncio.Event()    # set once submitted, or ended before it
        self.on_finish: list[Callable[[], None]] = []  # run once when it ends, however it ends

    async def start(self, wait_first: bool = True) -> None:
        """Submit and wait for the first event, so engine-side refusals still become a clean
        4xx/5xx before any streaming headers go out. ``wait_first=False`` waits only until the
        engine took the request (a fan-out's lead sibling: no wait for a token)."""
        if self.submit(ack=not wait_first):
            await self.first_event()

    def submit(self, ack: bool = False) -> bool:
        """Hand the request to the engine thread (False: it was cancelled before). ``ack``: the
        engine answers ACCEPTED once it took it. A fan-out submits most siblings this way alone:
        their refusals, if any, arrive through ``events``."""
        if self._done:
            return False
        self._started = True
        self.metrics.in_flight.inc()
        self.worker.in_flight += 1
        self._handle = self.worker.submit(self.rid, self.prompt_ids, self.sp, self.group, ack=ack)
        self._submitted.set()
        if self.request is not None and self.watch:
            self._watch = asyncio.create_task(self._watch_disconnect())
        return True

    async def first_event(self) -> None:
        try:
            first = await self._handle.events.get()
        except BaseException:  # cancelled while waiting: nobody will read it
            self.cancel()
            raise
        if first is ACCEPTED:
            return
        if isinstance(first, Finished) and first.finish_reason == "error":
            self._finish("error")
            e = first.error
            if first.rejected and isinstance(e, (ValueError, TypeError)):
                raise APIError(f"engine rejected the request: {client_message(e)}")
            raise APIError(f"engine error: {e}", status=500, type="server_error")
        if getattr(first, "finish_reason", None) == "error":  # ended by its own failed step
            self._absorb(first)
            raise self._step_error(first)
        self._pending.append(first)

    @staticmethod
    def _step_error(ev: Any) -> APIError:
        msg = (getattr(ev, "meta", None) or {}).get("error") or "the engine failed this request"
        return APIError(f"engine error: {msg}", status=500, type="server_error")

    async def events(self) -> AsyncIterator[tuple[str, list[int]]]:
        """Yield ``(text_delta, new_token_ids)`` until the request finishes.

        Events that queued up while the consumer was busy are merged into one yield: when the
        event loop falls behind the engine (many streams), it sends fewer, larger chunks instead
        of falling further behind one token at a time.
        """
        if self._handle is None:  # a fan-out sibling still outside its window
            await self._submitted.wait()
        try:
            while not self._done:
                batch = [self._pending.pop(0) if self._pending else await self._handle.events.get()]
                while not self._handle.events.empty():
                    batch.append(self._handle.events.get_nowait())
                delta, ids, ended = "", [], None
                failed = None
                for ev in batch:
                    if isinstance(ev, Finished):
                        ended = ev
                        break
                    if getattr(ev, "finish_reason", None) == "error":
                        failed = ev
                    d, new = self._absorb(ev)
                    delta, ids = delta + d, ids + new
                    if self._done:
                        break
                if delta or ids or (self._done and ended is None and failed is None):
                    yield delta, ids
                if failed is not None:
                    raise self._step_error(failed)
                if ended is not None and not self._done:
                    self._finish(ended.finish_reason)
                    if ended.finish_reason == "error":
                        raise APIError(f"engine error: {ended.error}", status=500, type="server_error")
                    if ended.finish_reason == SHUTDOWN:
                        raise APIError("the server is shutting down: this request was cut at the "
                                       "graceful-shutdown deadline", status=503,
                                       type="server_error", code=SHUTDOWN)
        finally:
            if not self._done:  # consumer left early (disconnect, cancellation): free the slots
                self.worker.abort(self.rid)
                self._finish("abort")

    def _absorb(self, ev: Any) -> tuple[str, list[int]]:
        """Account one StepOutput (metrics, counters, text); finishes the request if it is last."""
        ids = list(getattr(ev, "new_token_ids", None) or [])
        self.token_ids += ids
        self.token_logprobs += getattr(ev, "logprobs", None) or []
        if getattr(ev, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = ev.prompt_logprobs
        now = time.perf_counter()
        if ids and self._t_first is None:
            self._t_first = now
            self.metrics.ttft.observe(now - self._t0)
            self.metrics.prompt_tokens.inc(self.prompt_tokens)
        elif (self._t_first is None and getattr(ev, "finished", False)
              and getattr(ev, "finish_reason", None) == "length"):
            self._t_first = now  # prefill only (max_new_tokens 0): its prompt was processed too
            self.metrics.prompt_tokens.inc(int(getattr(ev, "prompt_tokens", 0) or self.prompt_tokens))
        self.metrics.generation_tokens.inc(len(ids))
        self.completion_tokens = int(getattr(ev, "completion_tokens", 0) or
                                     self.completion_tokens + len(ids))
        self.prompt_tokens = int(getattr(ev, "prompt_tokens", 0) or self.prompt_tokens)
        delta = getattr(ev, "text", "") or ""
        self.text += delta
        if getattr(ev, "finished", False):
            self.ds_stats = (getattr(ev, "meta", None) or {}).get("ds_stats")
            self._finish(getattr(ev, "finish_reason", None) or "stop")
        return delta, ids

    def cancel(self, notify: bool = True) -> None:
        """Abort a request whose events nobody will read (a sibling failed, the client left).
        ``notify=False``: the caller aborts it in the engine itself (one command for many)."""
        if not self._done:
            if notify and self._started:
                self.worker.abort(self.rid)
            self._finish("abort")

    async def collect(self) -> str:
        async for _ in self.events():
            pass
        return self.text

    def _finish(self, reason: str) -> None:
        if self._done:
            return
        self._done = True
        self.finish_reason = reason
        self._submitted.set()
        if self._watch is not None:
            self._watch.cancel()
        for fn in self.on_finish:
            fn()
        if not self._started:
            return
        self.metrics.in_flight.dec()
        self.worker.in_flight -= 1
        now = time.perf_counter()
        status = "disconnected" if self.disconnected else reason
        self.metrics.requests.labels(self.endpoint, status).inc()
        if reason in ("stop", "length"):
            self.metrics.e2e.observe(now - self._t0)
            if self._t_first is not None and self.completion_tokens > 1:
                self.metrics.tpot.observe((now - self._t_first) / (self.completion_tokens - 1))

    async def _watch_disconnect(self) -> None:
        # The body has been read already, so the next ASGI message can only be a disconnect.
        while True:
            msg = await self.request.receive()
            if msg["type"] == "http.disconnect":
                self.disconnected = True
                self.worker.abort(self.rid)
                return


def usage(g: Generation) -> dict:
    return {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.completion_tokens,
            "total_tokens": g.prompt_tokens + g.completion_tokens}
