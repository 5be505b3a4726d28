"""Generation routes: /v1/completions, /v1/chat/completions and SGLang-native /generate.

Each route runs the same pipeline: read the body under the size limit, validate strictly,
tokenize on the tokenizer thread, check lengths against the context window and the KV pool
(refuse what can never run, instead of truncating it or letting it wait forever), then hand the
request to the engine thread and either collect or stream the result.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from doublesparse.server import choices as C
from doublesparse.server import fields as F
from doublesparse.server.admission import client_key
from doublesparse.server import protocol as P
from doublesparse.server import tools as T
from doublesparse.server.generation import Generation
from doublesparse.server.http import new_id, read_body, sse, stream_response
from doublesparse.server.metrics import stat
from doublesparse.server.protocol import APIError
from doublesparse.server.state import ServerState


async def _begin(st: ServerState, request: Request, schema):
    if st.draining:
        raise APIError("server is draining: it finishes the requests it accepted and takes no new "
                       "ones", status=503, type="server_error", code="draining")
    if not st.worker.alive:
        why = f": {st.worker.fatal}" if st.worker.fatal is not None else ""
        raise APIError("engine is not running" + why, status=503, type="server_error",
                       code="engine_dead")
    req = P.parse(schema, await read_body(request, st.cfg.max_body_bytes))
    F.note_ignored(request, F.screen(req))
    P.unsupported(req)
    model = getattr(req, "model", None)
    if model is not None and model != st.model_name:
        raise APIError(f"the model '{model}' does not exist; this server serves '{st.model_name}'",
                       status=404, param="model", code="model_not_found")
    return req


def _encode(tok, text: str) -> list[int]:
    return list(tok.encode(text))


def _chat_encode(tok, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    kw = {"tools": tools} if tools else {}
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    return list(tok.encode(text, add_special_tokens=False))


# Prompts one completions request may carry (each is a request of its own in the engine).
MAX_PROMPTS = 128


def _prompt_list(prompt: Any) -> tuple[list, bool]:
    """A completions ``prompt`` as a list of prompts, and whether it was sent as a list."""
    many = bool(isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)))
    items = list(prompt) if many else [prompt]
    if len(items) > MAX_PROMPTS:
        raise APIError(f"at most {MAX_PROMPTS} prompts per request, got {len(items)}", param="prompt")
    return items, many


async def _prompts(st: ServerState, prompt: Any, param: str) -> list[list[int]]:
    """A completions ``prompt`` (one or a list, text or token ids) -> token ids per prompt."""
    items, many = _prompt_list(prompt)
    return [await _prompt_ids(st, p, f"{param}.{i}" if many else param)
            for i, p in enumerate(items)]


async def _prompt_ids(st: ServerState, prompt: Any, param: str) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError("send one prompt here", param=param, code="unsupported")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError("prompt must not be empty", param=param)
        return await st.tokenize(_encode, st.tokenizer, prompt)
    ids = list(prompt or [])
    if not ids:
        raise APIError("prompt must not be empty", param=param)
    if any(i < 0 or (st.vocab_size and i >= st.vocab_size) for i in ids):
        raise APIError(f"token ids must lie in [0, {st.vocab_size})", param=param)
    return ids


def _max_new(st: ServerState, n_prompt: int, asked: int | None, default: int | None,
             param: str, prompt_param: str, zero_ok: bool = False) -> int:
    """Explicit values are checked, defaults are clamped: never silently shorten an ask.
    ``zero_ok``: 0 (prefill only) is allowed (completions with echo)."""
    ctx, limit = st.max_context, st.cfg.max_new_tokens_limit
    kv_total = int(stat(st.worker.snapshot, "kv_total")) or None
    if ctx and n_prompt >= ctx:
        raise APIError(f"the prompt has {n_prompt} tokens but the context window is {ctx} tokens",
                       param=prompt_param, code="context_length_exceeded")
    if asked is None:
        room = [x for x in (default, limit, ctx and ctx - n_prompt,
                            kv_total and kv_total - n_prompt) if x is not None]
        asked = max(1, min(room)) if room else 16
    elif asked < 0 or (asked == 0 and not zero_ok):
        hint = " (0, the prompt alone, needs echo=true)" if asked == 0 and param == "max_tokens" \
            and prompt_param == "prompt" else ""
        raise APIError(f"{param} must be at least 1, got {asked}{hint}", param=param)
    elif limit and asked > limit:
        raise APIError(f"{param}={asked} exceeds this server's limit of {limit}", param=param)
    elif ctx and n_prompt + asked > ctx:
        raise APIError(f"the context window is {ctx} tokens, but {n_prompt + asked} were requested "
                       f"({n_prompt} in the prompt, {asked} to generate)", param=param,
                       code="context_length_exceeded")
    if kv_total and n_prompt + asked > kv_total:
        raise APIError(f"the request needs {n_prompt + asked} KV slots but the pool holds only "
                       f"{kv_total}", param=param, code="context_length_exceeded")
    return asked


def _sampling(st: ServerState, req: Any, max_new: int, prefix: str = "") -> dict:
    sp = {"max_new_tokens": max_new, "temperature": req.temperature, "top_p": req.top_p,
          "top_k": req.top_k, "stop": P.stop_list(req.stop),
          "stop_token_ids": list(req.stop_token_ids or []), "ignore_eos": req.ignore_eos}
    if req.seed is not None:
        sp["seed"] = req.seed
    sp.update(P.sampling_extras(req))
    sp.update(F.engine_fields(req, max_new, st.vocab_size, prefix))
    for f in ("enable_double_sparsity", "ds_heavy_token_num"):
        v = getattr(req, f, None)
        if v is None:
            continue
        if not st.ds_supported:
            raise APIError(f"{f} per request is not supported by this engine build", param=f,
                           code="unsupported")
        sp[f] = v
    return sp


def register_generation_routes(app: FastAPI, st: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _begin(st, request, P.CompletionRequest)
        # refuse an oversized fan-out before tokenizing its prompts
        st.admission.check_choices(len(_prompt_list(req.prompt)[0]), req.n, req.best_of)
        prompts = await _prompts(st, req.prompt, "prompt")
        max_new = min(_max_new(st, len(ids), req.max_tokens, st.cfg.default_completion_tokens,
                               "max_tokens", "prompt", zero_ok=req.echo) for ids in prompts)
        echo = [_echo_text(st, req.prompt, i) for i in range(len(prompts))] if req.echo else \
            [""] * len(prompts)
        scored = req.echo and req.logprobs is not None
        fo = C.Fanout(prompts, echo, req.n, req.best_of or req.n, chat=False,
                      want_logprobs=req.logprobs is not None, echo_logprobs=scored)
        sp = _sampling(st, req, max_new)
        if scored or max_new == 0:
            _check_scoring(st, "echo" if scored else "max_tokens")
        if scored:
            sp["prompt_logprobs"] = req.logprobs  # from the prefill, dense whether or not DS is on
        return await _run_openai(st, request, req, fo, sp)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _begin(st, request, P.ChatCompletionRequest)
        st.admission.check_choices(1, req.n, None)
        for i, m in enumerate(req.messages):
            if m.content is None and m.role != "assistant":
                raise APIError(f"messages.{i}.content is required for role '{m.role}'",
                               param=f"messages.{i}.content")
        tools = T.active_tools(req, st.tokenizer)
        grammar = T.forced_call_grammar(req) if tools else None
        messages = T.template_messages(req)
        try:
            ids = await st.tokenize(_chat_encode, st.tokenizer, messages, tools)
        except Exception as e:  # templates raise on orders they do not support
            raise APIError(f"could not apply the chat template: {e}", param="messages") from None
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_new = _max_new(st, len(ids), asked, None, param, "messages")
        sp = _sampling(st, req, max_new)
        if grammar is not None:
            sp["ebnf"] = grammar
        fo = C.Fanout([ids], [""], req.n, req.n, chat=True, want_logprobs=req.logprobs,
                      tools=tools is not None, parallel_tool_calls=req.parallel_tool_calls,
                      tool_names=frozenset(t["function"]["name"] for t in tools or ()))
        return await _run_openai(st, request, req, fo, sp)

    @app.post("/generate")
    async def generate(request: Request):
        req = await _begin(st, request, P.GenerateRequest)
        if (req.text is None) == (req.input_ids is None):
            raise APIError("send exactly one of 'text' and 'input_ids'", param="text")
        ids = await _prompt_ids(st, req.text if req.text is not None else req.input_ids,
                                "text" if req.text is not None else "input_ids")
        sp_in = req.sampling_params
        if sp_in.n != 1:
            raise APIError("n > 1 is served by /v1/completions and /v1/chat/completions",
                           param="sampling_params.n", code="unsupported")
        max_new = _max_new(st, len(ids), sp_in.max_new_tokens, None,
                           "sampling_params.max_new_tokens", "text")
        sp = _sampling(st, sp_in, max_new, "sampling_params.")
        if req.return_ds_stats:
            if "return_ds_stats" not in st.sampling_fields:
                raise APIError("return_ds_stats is not supported by this engine", param="return_ds_stats",
                               code="unsupported")
            sp["return_ds_stats"] = True
        rid, client = new_id("gen"), client_key(request)  # the engine's id is always ours
        label = req.rid if req.rid is not None else rid
        _tag(request, rid if req.rid is None else f"{rid} (rid {req.rid!r})")
        releases = [st.admission.claim_rid(client, req.rid)] if req.rid is not None else []
        try:
            releases.append(st.admission.acquire(client, 1))
        except APIError:
            for release in releases:
                release()
            raise
        g = make_generation(st, "generate", rid, ids, sp, request)
        g.on_finish += releases
        await g.start()

        def out() -> dict:
            return {"text": g.text, "meta_info": {
                "id": label, "prompt_tokens": g.prompt_tokens,
                "completion_tokens": g.completion_tokens,
                "finish_reason": {"type": g.finish_reason} if g.finish_reason else None,
                "e2e_latency": time.perf_counter() - g._t0,
                **({"ds_stats": g.ds_stats} if req.return_ds_stats and g.finish_reason else {})}}

        if not req.stream:
            await g.collect()
            return out()

        async def native_stream():
            try:
                async for _ in g.events():
                    yield sse(out())  # SGLang streams the cumulative text
                if g.completion_tokens == 0:
                    yield sse(out())
            except APIError as e:
                C.log_stream_error(e, rid)
                yield sse(e.body())
            yield "data: [DONE]\n\n"
        return stream_response(native_stream())


def _check_scoring(st: ServerState, param: str) -> None:
    """echo with logprobs needs the engine's prompt logprobs, max_tokens=0 a prefill-only request:
    engines that have prompt_logprobs do both."""
    if "prompt_logprobs" not in st.sampling_fields:
        what = "echo with logprobs" if param == "echo" else "max_tokens=0"
        raise APIError(f"{what} needs prompt logprobs / prefill-only requests, which this engine "
                       "does not support", param=param, code="unsupported")


def _echo_text(st: ServerState, prompt: Any, i: int) -> str:
    p = prompt[i] if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) \
        else prompt
    return p if isinstance(p, str) else st.tokenizer.decode(p, skip_special_tokens=False)


def _token_text(st: ServerState):
    if getattr(st, "_token_text", None) is None:
        st._token_text = C.TokenText(st.tokenizer)
    return st._token_text


def _tag(request: Request, rid: str) -> None:
    """Name the request in the scope, for the log line of any 5xx it gets."""
    request.scope.setdefault("state", {})["request_id"] = rid


async def _run_openai(st: ServerState, request: Request, req: Any, fo: C.Fanout, sp: dict):
    rid = new_id("chatcmpl" if fo.chat else "cmpl")
    _tag(request, rid)
    k = len(fo.prompts) * fo.best_of
    release = st.admission.acquire(client_key(request), k)  # 429 past the client's share
    made = 0

    def make(sub_rid, ids, sp_j, req_, watch=True):
        nonlocal made
        g = make_generation(st, "chat" if fo.chat else "completions", sub_rid, ids, sp_j, req_,
                            watch=watch, group=rid)
        g.on_finish.append(release)
        made += 1
        return g

    try:
        choices, guard = await C.start(make, rid, fo, sp, request, st.worker, st.fanout_window)
    except BaseException:
        for _ in range(k - made):  # choices never made hold no share
            release()
        raise
    base = {"id": rid, "object": "chat.completion.chunk" if fo.chat else "text_completion",
            "created": int(time.time()), "model": st.model_name}
    tt = _token_text(st) if fo.want_logprobs else None
    if req.stream:
        include = bool(req.stream_options and req.stream_options.include_usage)
        return stream_response(C.stream(fo, choices, base, include, tt, guard, st.worker))
    await C.collect(choices, guard, st.worker)
    if choices[0].gen.disconnected:
        # nobody will read it: not even built (a 16K fan-out's body is seconds of event-loop time)
        return Response(status_code=499)
    for c in choices:
        if c.gen.finish_reason == "error":
            raise APIError("engine error: the engine failed this request", status=500,
                           type="server_error")
    out = [C.response_choice(fo, c, tt) for c in C.best(fo, choices)]
    obj = {**base, "object": "chat.completion"} if fo.chat else base
    # plain JSON types already: FastAPI's encoder would walk every value again (~0.1 ms a choice)
    return JSONResponse({**obj, "choices": out, "usage": C.usage(fo, choices)})


def make_generation(st: ServerState, endpoint: str, rid: str, ids: list[int], sp: dict,
                    request: Request, watch: bool = True, group: str | None = None) -> Generation:
    return Generation(st.worker, st.metrics, endpoint, rid, ids, sp, request, watch=watch,
                      group=group)
