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

from doublesparse.server import protocol as P
from doublesparse.server.generation import Generation, usage
from doublesparse.server.http import new_id, read_body, sse, stream_response
from doublesparse.server.metrics import stat
from doublesparse.server.protocol import APIError
from doublesparse.server.state import ServerState


async def _begin(st: ServerState, request: Request, schema):
    if st.draining:
        raise APIError("server is draining: it finishes the requests it accepted and takes no new "
                       "ones", status=503, type="server_error", code="draining")
    if not st.worker.alive:
        raise APIError("engine is not running", status=503, type="server_error")
    req = P.parse(schema, await read_body(request, st.cfg.max_body_bytes))
    P.unsupported(req)
    model = getattr(req, "model", None)
    if model is not None and model != st.model_name:
        raise APIError(f"the model '{model}' does not exist; this server serves '{st.model_name}'",
                       status=404, param="model", code="model_not_found")
    return req


def _encode(tok, text: str) -> list[int]:
    return list(tok.encode(text))


def _chat_encode(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tok.encode(text, add_special_tokens=False))


async def _prompt_ids(st: ServerState, prompt: Any, param: str) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError("batched prompts are not supported; send one prompt per request",
                           param=param, code="unsupported")
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
             param: str, prompt_param: str) -> int:
    """Explicit values are checked, defaults are clamped: never silently shorten an ask."""
    ctx, limit = st.max_context, st.cfg.max_new_tokens_limit
    kv_total = int(stat(st.worker.snapshot, "kv_total")) or None
    if ctx and n_prompt >= ctx:
        raise APIError(f"the prompt has {n_prompt} tokens but the context window is {ctx} tokens",
                       param=prompt_param, code="context_length_exceeded")
    if asked is None:
        room = [x for x in (default, limit, ctx and ctx - n_prompt,
                            kv_total and kv_total - n_prompt) if x is not None]
        asked = max(1, min(room)) if room else 16
    elif asked <= 0:
        raise APIError(f"{param} must be at least 1, got {asked}", param=param)
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


def _sampling(st: ServerState, req: Any, max_new: int) -> dict:
    sp = {"max_new_tokens": max_new, "temperature": req.temperature, "top_p": req.top_p,
          "top_k": req.top_k, "stop": P.stop_list(req.stop),
          "stop_token_ids": list(req.stop_token_ids or []), "ignore_eos": req.ignore_eos}
    if req.seed is not None:
        sp["seed"] = req.seed
    for f in ("enable_double_sparsity", "ds_heavy_token_num"):
        v = getattr(req, f, None)
        if v is None:
            continue
        if not st.ds_supported:
            raise APIError(f"{f} per request is not supported by this engine build", param=f,
                           code="unsupported")
        sp[f] = v
    return sp


async def _stream_openai(g: Generation, base: dict, chat: bool, include_usage: bool):
    """OpenAI chunk stream; errors after the headers went out travel as an error event."""
    def chunk(payload: dict, finish: str | None) -> str:
        choice = {"index": 0, **payload, "logprobs": None, "finish_reason": finish}
        return sse({**base, "choices": [choice]})

    try:
        if chat:
            yield chunk({"delta": {"role": "assistant", "content": ""}}, None)
        async for delta, _ in g.events():
            if delta:
                yield chunk({"delta": {"content": delta}} if chat else {"text": delta}, None)
        yield chunk({"delta": {}} if chat else {"text": ""}, g.finish_reason)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(g)})
    except APIError as e:
        yield sse(e.body())
    yield "data: [DONE]\n\n"


def register_generation_routes(app: FastAPI, st: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _begin(st, request, P.CompletionRequest)
        ids = await _prompt_ids(st, req.prompt, "prompt")
        max_new = _max_new(st, len(ids), req.max_tokens, st.cfg.default_completion_tokens,
                           "max_tokens", "prompt")
        return await _run_openai(st, request, req, ids, max_new, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _begin(st, request, P.ChatCompletionRequest)
        for i, m in enumerate(req.messages):
            if m.content is None and m.role != "assistant":
                raise APIError(f"messages.{i}.content is required for role '{m.role}'",
                               param=f"messages.{i}.content")
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in req.messages]
        try:
            ids = await st.tokenize(_chat_encode, st.tokenizer, msgs)
        except Exception as e:  # templates raise on orders they do not support
            raise APIError(f"could not apply the chat template: {e}", param="messages") from None
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_new = _max_new(st, len(ids), asked, None, param, "messages")
        return await _run_openai(st, request, req, ids, max_new, chat=True)

    @app.post("/generate")
    async def generate(request: Request):
        req = await _begin(st, request, P.GenerateRequest)
        if (req.text is None) == (req.input_ids is None):
            raise APIError("send exactly one of 'text' and 'input_ids'", param="text")
        ids = await _prompt_ids(st, req.text if req.text is not None else req.input_ids,
                                "text" if req.text is not None else "input_ids")
        sp_in = req.sampling_params
        P.unsupported(sp_in)
        max_new = _max_new(st, len(ids), sp_in.max_new_tokens, None,
                           "sampling_params.max_new_tokens", "text")
        g = make_generation(st, "generate", req.rid or new_id("gen"), ids,
                            _sampling(st, sp_in, max_new), request)
        await g.start()

        def out() -> dict:
            return {"text": g.text, "meta_info": {
                "id": g.rid, "prompt_tokens": g.prompt_tokens,
                "completion_tokens": g.completion_tokens,
                "finish_reason": {"type": g.finish_reason} if g.finish_reason else None,
                "e2e_latency": time.perf_counter() - g._t0}}

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
                yield sse(e.body())
            yield "data: [DONE]\n\n"
        return stream_response(native_stream())


async def _run_openai(st: ServerState, request: Request, req: Any, ids: list[int], max_new: int,
                      chat: bool):
    rid = new_id("chatcmpl" if chat else "cmpl")
    g = make_generation(st, "chat" if chat else "completions", rid, ids,
                        _sampling(st, req, max_new), request)
    await g.start()
    base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": st.model_name}
    if req.stream:
        include = bool(req.stream_options and req.stream_options.include_usage)
        return stream_response(_stream_openai(g, base, chat, include))
    await g.collect()
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": g.text},
                  "logprobs": None, "finish_reason": g.finish_reason}
        return {**base, "object": "chat.completion", "choices": [choice], "usage": usage(g)}
    choice = {"index": 0, "text": g.text, "logprobs": None, "finish_reason": g.finish_reason}
    return {**base, "choices": [choice], "usage": usage(g)}


def make_generation(st: ServerState, endpoint: str, rid: str, ids: list[int], sp: dict,
                    request: Request) -> Generation:
    return Generation(st.worker, st.metrics, endpoint, rid, ids, sp, request)
