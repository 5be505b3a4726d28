"""The engine thread.

The engine is not thread-safe, so exactly one thread (this one) calls add_request / step /
abort / stats. HTTP handlers talk to it through a command queue; results travel back to each
request's asyncio queue with ``loop.call_soon_threadsafe``, so the event loop never blocks on
a decode step and the engine never waits for the network.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("doublesparse.server")


@dataclass
class Finished:
    """Synthetic end-of-request event for requests that end without a final StepOutput."""

    finish_reason: str
    error: BaseException | None = None
    rejected: bool = False  # True: add_request refused it (client's fault), not a step failure


class Accepted:
    """Event pushed when the engine took the request (only to handles that asked: ``ack``)."""


ACCEPTED = Accepted()


@dataclass
class RequestHandle:
    """What a handler holds for one in-flight request; ``events`` receives StepOutputs."""

    rid: str
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    ack: bool = False  # push ACCEPTED once the engine took it (fan-out: no wait for a token)

    def push(self, items: list[Any]) -> None:  # runs on the event loop
        for it in items:
            self.events.put_nowait(it)


class EngineWorker:
    """Owns the engine; runs ``step()`` whenever any request is unfinished.

    A failed step never stops the server: the requests it held end with an error (the engine
    already ends a request whose own sampling fails and lets the rest of its batch go on), the
    failure is counted, and the loop goes on with the requests that arrive next. Only an engine
    that cannot even be reset after a failure is marked dead.
    """

    STATS_INTERVAL = 0.05  # refresh the stats snapshot at most 20x/s while decoding
    ADDS_PER_PASS = 64  # requests handed to the engine between two steps

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[str, RequestHandle] = {}  # engine thread only
        # adds not yet handed to the engine, by group (round robin, like the engine's admission):
        # a 16K fan-out's adds take ~0.5 s of engine time, and a request sent meanwhile must
        # not wait behind all of them; an abort drops a parked add on the spot
        self._parked: OrderedDict[str, deque] = OrderedDict()
        self._parked_rids: dict[str, RequestHandle] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.snapshot: dict = {}  # latest engine.stats(); replaced whole, so readers never see half
        self.in_flight = 0  # requests accepted by handlers and not yet finished (event loop only)
        self.step_errors = 0
        self.fatal: BaseException | None = None
        self.closed: str | None = None  # set by abort_all: later adds end at once with this reason
        self._groups = _takes_group(engine)

    # --- called from the event loop -------------------------------------------------------
    def start(self) -> None:
        self._refresh_stats(force=True)  # before the thread starts: nobody else touches the engine yet
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    def submit(self, rid: str, prompt_ids: list[int], sampling_params: Any,
               group: str | None = None, ack: bool = False) -> RequestHandle:
        """``group``: the client request it belongs to (fair admission among fanned-out
        siblings and other requests), for engines that take one."""
        handle = RequestHandle(rid, asyncio.get_running_loop(), ack=ack)
        self._cmds.put(("add", handle, prompt_ids, sampling_params, group))
        return handle

    def abort(self, rid: str) -> None:
        self._cmds.put(("abort", (rid,), "abort"))

    def abort_many(self, rids: list[str]) -> None:
        """One command for a whole fan-out: its siblings leave the engine together."""
        if rids:
            self._cmds.put(("abort", tuple(rids), "abort"))

    def abort_all(self, reason: str) -> None:
        """End every request now with ``reason`` (e.g. "shutdown" at the drain deadline), and
        every request submitted later too. Thread-safe."""
        self._cmds.put(("abort_all", reason))

    def call(self, fn, *args) -> "asyncio.Future":
        """Run ``fn(engine, *args)`` on the engine thread (e.g. an offline reference)."""
        fut = asyncio.get_running_loop().create_future()
        self._cmds.put(("call", fut, fn, args))
        return fut

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop after the requests still known to the engine are done (or aborted on timeout)."""
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("engine thread did not stop within %.0fs", timeout)

    # --- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        last_stats, failures = 0.0, 0
        while True:
            busy = self._safe(self.engine.has_unfinished, default=False)
            if (self._stop.is_set() and not busy and not self._handles and not self._parked
                    and self._cmds.empty()):
                break
            self._drain(block=not busy and not self._parked)
            self._add_parked(self.ADDS_PER_PASS)
            if self._safe(self.engine.has_unfinished, default=False):
                try:
                    outs = self.engine.step()
                    failures = 0
                except Exception as e:  # keep serving: fail the batch, not the process
                    self.step_errors += 1
                    failures += 1
                    log.exception("engine.step() failed; ending the %d requests it held",
                                  len(self._handles))
                    outs = self._recover(e)
                    time.sleep(min(0.05 * failures, 1.0))  # no busy spin on a broken device
                self._dispatch(outs)
            now = time.perf_counter()
            if now - last_stats >= self.STATS_INTERVAL or not self._handles:
                self._refresh_stats()
                last_stats = now
        self._refresh_stats()

    def _drain(self, block: bool) -> None:
        """Take every queued command: adds are parked, the rest handled at once."""
        try:
            cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd[0] == "add":
                _, handle, _, _, group = cmd
                self._parked.setdefault(group or handle.rid, deque()).append(cmd)
                self._parked_rids[handle.rid] = handle
            else:
                self._handle_cmd(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _add_parked(self, limit: int) -> None:
        """Hand up to ``limit`` parked adds to the engine, one group after another."""
        n = 0
        while self._parked and n < limit:
            group, cmds = next(iter(self._parked.items()))
            cmd = cmds.popleft()
            if cmds:
                self._parked.move_to_end(group)
            else:
                del self._parked[group]
            if self._parked_rids.pop(cmd[1].rid, None) is not None:  # else aborted meanwhile
                self._add(*cmd[1:])
                n += 1

    def _add(self, handle: RequestHandle, prompt_ids, sp, group) -> None:
        if self.fatal is not None or self.closed is not None:
            end = Finished("error", self.fatal) if self.fatal is not None else Finished(self.closed)
            handle.loop.call_soon_threadsafe(handle.push, [end])
            return
        kw = {"group": group} if group is not None and self._groups else {}
        try:
            self.engine.add_request(prompt_ids, sp, request_id=handle.rid, **kw)
        except Exception as e:  # engine-side validation: answer this request only
            handle.loop.call_soon_threadsafe(handle.push, [Finished("error", e, rejected=True)])
            return
        self._handles[handle.rid] = handle
        if handle.ack:
            handle.loop.call_soon_threadsafe(handle.push, [ACCEPTED])

    def _handle_cmd(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "abort":
            _, rids, reason = cmd
            self._abort(rids, reason)
        elif kind == "abort_all":
            self.closed = cmd[1]
            self._abort([*self._handles, *self._parked_rids], cmd[1])
        elif kind == "call":
            _, fut, fn, args = cmd
            try:
                res = fn(self.engine, *args)
            except Exception as e:
                fut.get_loop().call_soon_threadsafe(_set_exc, fut, e)
            else:
                fut.get_loop().call_soon_threadsafe(_set_result, fut, res)

    def _abort(self, rids, reason: str) -> None:
        freed = False
        for rid in rids:
            parked = self._parked_rids.pop(rid, None)
            if parked is not None:  # never reached the engine
                parked.loop.call_soon_threadsafe(parked.push, [Finished(reason)])
                continue
            handle = self._handles.pop(rid, None)
            if handle is None:
                continue  # already finished: nothing holds slots any more
            self._safe(self.engine.abort, rid)
            handle.loop.call_soon_threadsafe(handle.push, [Finished(reason)])
            freed = True
        if freed:
            self._refresh_stats(force=True)  # so /metrics shows the freed KV right away

    def _dispatch(self, outs: list) -> None:
        grouped: dict[str, list] = {}
        for o in outs:
            grouped.setdefault(o.request_id, []).append(o)
        for rid, items in grouped.items():
            handle = self._handles.get(rid)
            if handle is None:
                continue  # aborted meanwhile
            if any(o.finished for o in items):
                del self._handles[rid]
            handle.loop.call_soon_threadsafe(handle.push, items)

    def _recover(self, err: BaseException) -> list:
        """The engine's own reset when it has one (it frees the failed step's slots); otherwise
        abort every request. Requests the reset did not end keep running."""
        reset = getattr(self.engine, "fail_running", None)
        if reset is None:
            self._fail_all(err)
            return []
        try:
            return reset(err)
        except Exception as e2:
            log.exception("engine reset after a failed step failed; the engine is dead")
            self.fatal = e2  # /health turns 503 and new requests are refused
            self._fail_all(err)
            return []

    def _fail_all(self, err: BaseException) -> None:
        for rid, handle in list(self._handles.items()):
            self._safe(self.engine.abort, rid)
            handle.loop.call_soon_threadsafe(handle.push, [Finished("error", err)])
        self._handles.clear()

    def _refresh_stats(self, force: bool = False) -> None:
        snap = self._safe(self.engine.stats, default=None)
        if isinstance(snap, dict):
            self.snapshot = dict(snap)

    @staticmethod
    def _safe(fn, *args, default=None):
        try:
            return fn(*args)
        except Exception:
            log.exception("engine call %s failed", getattr(fn, "__name__", fn))
            return default


def _takes_group(engine: Any) -> bool:
    try:
        return "group" in inspect.signature(engine.add_request).parameters
    except (TypeError, ValueError):
        return False


def _set_result(fut: asyncio.Future, res: Any) -> None:
    if not fut.done():
        fut.set_result(res)


def _set_exc(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
