"""The choices of one OpenAI request: ``n`` samples of each prompt (``best_of`` to pick from),
each a sibling request of the engine, collected into one response or merged into one stream.

All fan-out happens here, so siblings reach the engine as ordinary requests with the same prompt
(a prefix cache shares their prompt's KV). Choice ``index`` follows OpenAI and vLLM: prompt ``i``'s
``j``-th sample is ``i * n + j``. A seeded request gives sample ``j`` the seed ``seed + j`` (so the
samples differ, and the response is reproducible).

A fanned-out request (more than one sibling) is watched as a whole from the moment it is accepted:
one task waits for the client's ``http.disconnect`` and then aborts every sibling in one engine
command, whether they are still queued, running, or streaming. Siblings share the request's id
as their fair-admission group, so the engine admits them in turn with other requests.

Only a window of a fan-out's siblings is in the engine at a time (each prompt's first sibling, and
up to ``window`` of the others, the next one submitted as one ends): the engine thread never spends
its time taking in thousands of adds while other requests wait, and an abandoned fan-out leaves
little behind to abort.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from doublesparse.server.generation import Generation
from doublesparse.server.http import sse
from doublesparse.server.logprobs import TokenText, chat_logprobs, completion_logprobs, echo_logprobs
from doublesparse.server.protocol import APIError
from doublesparse.server.tools import parse_tool_calls

_I64 = 2**63 - 1
SUBMIT_CHUNK = 64  # siblings handed to the engine thread between yields to the event loop
COLLECT_CHUNK = 32  # finished siblings read between yields
log = logging.getLogger("doublesparse.server")


@dataclass
class Choice:
    index: int
    gen: Generation
    prefix: str = ""              # echoed prompt text (completions with echo)
    prompt_i: int = 0
    offset: int = 0               # text length sent so far (completions' text_offset)
    held: list = field(default_factory=list)   # text kept back until the end (tool parsing)
    feeder: "Feeder | None" = None  # the fan-out's submission window, shared by its siblings
    echoed: bool = False          # streamed: the prompt went out (with echo and logprobs, late)


@dataclass
class Fanout:
    """What the route decided: prompts (ids and their echo text), samples per prompt, and how
    the output is shaped."""

    prompts: list[list[int]]
    echo_texts: list[str]
    n: int
    best_of: int
    chat: bool
    want_logprobs: bool           # the client asked (best_of may ask internally too)
    tools: bool = False           # parse <tool_call> blocks out of the text
    # echo with logprobs: the echoed prompt carries its tokens' logprobs (the engine's prompt
    # logprobs), ahead of the completion's
    echo_logprobs: bool = False
    parallel_tool_calls: bool = True
    tool_names: frozenset = frozenset()   # the request's tools: bare call objects naming them count


def sibling_params(sp: dict, j: int) -> dict:
    if j == 0 or sp.get("seed") is None:
        return sp
    s = sp["seed"] + j
    return {**sp, "seed": s if s <= _I64 else sp["seed"] - j}


class Guard:
    """Aborts every sibling of a fanned-out request when its client disconnects; runs from
    acceptance until the response ends (``stop``)."""

    def __init__(self, request, choices: list[Choice], worker) -> None:
        self.request, self.choices, self.worker = request, choices, worker
        self.task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        # the body has been read already, so the next ASGI message can only be a disconnect
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        for c in self.choices:
            c.gen.disconnected = True
        cancel_all(self.choices, self.worker)

    def stop(self) -> None:
        self.task.cancel()


class Feeder:
    """Submits a fan-out's siblings in order, keeping at most ``window`` of them unfinished in the
    engine: each one's end (read by the consumer, or cancelled) submits the next. Consumers read
    siblings in index order, and every sibling before an unsubmitted one has ended, so the window
    always has room for the one being waited on."""

    def __init__(self, pending: list[Choice], window: int) -> None:
        self.pending = deque(pending)
        self.room = max(1, int(window))
        self.stopped = False

    def fill(self) -> None:
        while self.room > 0 and self.pending and not self.stopped:
            g = self.pending.popleft().gen
            if g.submit():
                self.room -= 1
                g.on_finish.append(self._freed)

    def _freed(self) -> None:
        self.room += 1
        self.fill()


def cancel_all(choices: list[Choice], worker) -> None:
    """End every unfinished sibling, with one abort command for all of them."""
    if choices and choices[0].feeder is not None:
        choices[0].feeder.stopped = True  # no sibling is submitted while the others are cancelled
    live = [c.gen for c in choices if not c.gen._done]
    worker.abort_many([g.rid for g in live if g._started])
    for g in live:
        g.cancel(notify=False)


async def start(make: Callable[..., Generation], rid: str, fo: Fanout, sp: dict,
                request, worker, window: int = 256) -> tuple[list[Choice], Guard | None]:
    """Submit the siblings (a fan-out's in a :class:`Feeder` of ``window``); if one is refused,
    abort those already started. A lone request waits for its first token (engine refusals become
    a clean error before any header); a fan-out only until the engine took each prompt's first
    sibling, watched for a disconnect throughout."""
    per = fo.best_of
    many = len(fo.prompts) * per > 1
    if fo.best_of > fo.n and "logprobs" not in sp:
        sp = {**sp, "logprobs": 0}  # best_of ranks samples by their cumulative logprob
    choices: list[Choice] = []
    guard = Guard(request, choices, worker) if many and request is not None else None
    try:
        for i, ids in enumerate(fo.prompts):
            for j in range(per):
                g = make(f"{rid}-{i * per + j}" if many else rid, ids, sibling_params(sp, j),
                         request, watch=not many)
                choices.append(Choice(i * per + j, g, fo.echo_texts[i], i, len(fo.echo_texts[i])))
                if len(choices) % SUBMIT_CHUNK == 0:
                    await asyncio.sleep(0)
        if not many:
            await choices[0].gen.start()
            return choices, guard
        # Each prompt's first sibling goes out at once and waits until the engine took it (the
        # engine's refusals depend on the prompt and parameters, which its siblings share, so
        # they become a clean error before any header); the others through the window.
        lead = [c for c in choices if c.index % per == 0]
        feeder = Feeder([c for c in choices if c.index % per], window)
        for c in choices:
            c.feeder = feeder
        for k in range(0, len(lead), SUBMIT_CHUNK):
            for c in lead[k:k + SUBMIT_CHUNK]:
                c.gen.submit(ack=True)
            await asyncio.sleep(0)
        feeder.fill()
        results = await asyncio.gather(*(c.gen.first_event() for c in lead if c.gen._started),
                                       return_exceptions=True)
    except BaseException:  # a refusal, or cancelled (the client left): nobody will read these
        _end(choices, guard, worker)
        raise
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        _end(choices, guard, worker)
        raise failed[0]
    return choices, guard


def _end(choices: list[Choice], guard: Guard | None, worker) -> None:
    if guard is not None:
        guard.stop()
    cancel_all(choices, worker)


def usage(fo: Fanout, choices: list[Choice]) -> dict:
    prompt = sum(len(p) for p in fo.prompts)
    done = {}
    for c in choices:  # the engine's count (it may differ from len(ids) by specials)
        done.setdefault(c.prompt_i, c.gen.prompt_tokens)
    prompt = sum(done.values()) or prompt
    comp = sum(c.gen.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": comp, "total_tokens": prompt + comp}


async def _spawn(choices: list[Choice], fn) -> list[asyncio.Task]:
    """A task per choice, created ``SUBMIT_CHUNK`` at a time with a yield to the event loop in
    between: 16,384 tasks at once would hold up every other request for most of a second."""
    tasks: list[asyncio.Task] = []
    for k in range(0, len(choices), SUBMIT_CHUNK):
        tasks += [asyncio.create_task(fn(c)) for c in choices[k:k + SUBMIT_CHUNK]]
        if len(choices) > SUBMIT_CHUNK:
            await asyncio.sleep(0)
    return tasks


async def collect(choices: list[Choice], guard: Guard | None, worker) -> None:
    """Run every sibling to the end; a disconnect (the guard) or a failure aborts all of them.
    One sibling after another, not a task each: events queue up per sibling meanwhile, and the
    event loop gets a turn every ``COLLECT_CHUNK`` siblings, so the backlog of a 16K fan-out is
    read in small pieces between other requests' work."""
    try:
        for k, c in enumerate(choices):
            await c.gen.collect()
            if k % COLLECT_CHUNK == COLLECT_CHUNK - 1:
                await asyncio.sleep(0)
    finally:
        _end(choices, guard, worker)


def log_stream_error(e: APIError, rid: str) -> None:
    """Errors sent after the headers (an error event) are logged like a 5xx response."""
    if e.status >= 500:
        log.error("request %s: %d %s in its stream: %s", rid, e.status, e.code or e.type, e.message)


def best(fo: Fanout, choices: list[Choice]) -> list[Choice]:
    """The n of each prompt's best_of samples with the highest cumulative logprob, re-indexed."""
    if fo.best_of == fo.n:
        return choices
    out = []
    for i in range(len(fo.prompts)):
        mine = [c for c in choices if c.prompt_i == i]
        mine.sort(key=lambda c: -sum(lp for lp, _ in c.gen.token_logprobs))
        for j, c in enumerate(mine[:fo.n]):
            c.index = i * fo.n + j
            out.append(c)
    return out


def response_choice(fo: Fanout, c: Choice, tt: TokenText | None) -> dict:
    g = c.gen
    lp = None
    if fo.want_logprobs and tt is not None:
        if fo.chat:
            lp = chat_logprobs(tt, g.token_ids, g.token_logprobs)
        elif fo.echo_logprobs:
            lp = echo_logprobs(tt, fo.prompts[c.prompt_i], g.prompt_logprobs, g.token_ids,
                               g.token_logprobs, len(c.prefix))
        else:
            lp = completion_logprobs(tt, g.token_ids, g.token_logprobs, len(c.prefix))
    if not fo.chat:
        return {"index": c.index, "text": c.prefix + g.text, "logprobs": lp,
                "finish_reason": g.finish_reason}
    msg: dict[str, Any] = {"role": "assistant", "content": g.text}
    finish = g.finish_reason
    if fo.tools:
        msg["content"], calls = parse_tool_calls(g.text, fo.parallel_tool_calls, fo.tool_names)
        if calls:
            msg["tool_calls"] = calls
            finish = "tool_calls" if finish == "stop" else finish
    return {"index": c.index, "message": msg, "logprobs": lp, "finish_reason": finish}


async def stream(fo: Fanout, choices: list[Choice], base: dict, include_usage: bool,
                 tt: TokenText | None, guard: Guard | None, worker):
    """OpenAI chunk stream of all choices, in the order their tokens arrive; errors after the
    headers went out travel as an error event."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            async for delta, ids in c.gen.events():
                # the generator is paused at its yield: the lists end with exactly these tokens
                lps = c.gen.token_logprobs[len(c.gen.token_logprobs) - len(ids):] \
                    if fo.want_logprobs and ids else []
                q.put_nowait((c, delta, ids, lps, None))
            q.put_nowait((c, "", [], [], "end"))
        except APIError as e:
            q.put_nowait((c, "", [], [], e))

    def chunk(c: Choice, payload: dict, finish: str | None, lp=None) -> str:
        choice = {"index": c.index, **payload, "logprobs": lp, "finish_reason": finish}
        return sse({**base, "choices": [choice]})

    def lp_of(c: Choice, ids: list[int], lps: list):
        if not (fo.want_logprobs and tt is not None and ids):
            return None
        if fo.chat:
            return chat_logprobs(tt, ids, lps)
        out = completion_logprobs(tt, ids, lps, c.offset)
        c.offset = out["text_offset"][-1] + len(out["tokens"][-1])
        return out

    def echo(c: Choice) -> str:
        """The echoed prompt; with logprobs, once its logprobs arrived (with the first output)."""
        c.echoed = True
        lp = None
        if fo.echo_logprobs and tt is not None:
            ids = fo.prompts[c.prompt_i]
            lp = completion_logprobs(tt, ids, c.gen.prompt_logprobs or [None] * len(ids), 0)
        return chunk(c, {"text": c.prefix}, None, lp)

    tasks: list[asyncio.Task] = []
    try:
        tasks = await _spawn(choices, pump)
        for k, c in enumerate(choices):
            if fo.chat:
                yield chunk(c, {"delta": {"role": "assistant", "content": ""}}, None)
            elif c.prefix and not fo.echo_logprobs:
                yield echo(c)
            if k % SUBMIT_CHUNK == SUBMIT_CHUNK - 1:
                await asyncio.sleep(0)  # let other requests run between chunks of a fan-out
        live = len(choices)
        while live:
            c, delta, ids, lps, end = await q.get()
            if isinstance(end, APIError):
                log_stream_error(end, base["id"])
                yield sse(end.body())
                break
            if c.prefix and not c.echoed and not fo.chat:
                yield echo(c)
            if end == "end":
                live -= 1
                yield _final(fo, c, chunk)
                continue
            if fo.tools:
                c.held.append(delta)
                continue
            if delta or ids:
                lp = lp_of(c, ids, lps)
                yield chunk(c, {"delta": {"content": delta}} if fo.chat else {"text": delta}, None, lp)
        else:
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(fo, choices)})
    finally:
        _end(choices, guard, worker)  # before the pumps stop: one abort for all that still run
        for t in tasks:
            t.cancel()
    yield "data: [DONE]\n\n"


def _final(fo: Fanout, c: Choice, chunk) -> str:
    g = c.gen
    if not fo.tools:
        return chunk(c, {"delta": {}} if fo.chat else {"text": ""}, g.finish_reason)
    # tools: the whole message at the end, parsed (tool-call markup is never streamed raw)
    content, calls = parse_tool_calls("".join(c.held), fo.parallel_tool_calls,
                                     fo.tool_names)
    delta: dict[str, Any] = {"content": content}
    finish = g.finish_reason
    if calls:
        delta["tool_calls"] = [{**call, "index": k} for k, call in enumerate(calls)]
        finish = "tool_calls" if g.finish_reason == "stop" else finish
    return chunk(c, {"delta": delta}, finish)
