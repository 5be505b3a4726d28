"""Which request fields are served, refused or ignored, and the translation of logit_bias,
min_tokens, skip_special_tokens and the structured outputs into engine sampling parameters.

The policy (the README states it): every field the request models declare is served. A field
that OpenAI, vLLM or SGLang define and this server does not serve is refused with a 400 naming
it, unless it is null or has the value that asks for what the server does anyway (e.g.
``use_beam_search: false``). Any other field is ignored, as vLLM ignores unknown fields: the
response's ``X-Ignored-Fields`` header names it and the server logs a warning.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from doublesparse.server import protocol as P
from doublesparse.server.protocol import APIError
from doublesparse.server.request_base import Strict, StructuredOutputs

log = logging.getLogger("doublesparse.server")
IGNORED_HEADER = "X-Ignored-Fields"

# Known, not served: name -> the value that asks for this server's behaviour (accepted).
_OPENAI_UNSERVED = {
    # vLLM
    "use_beam_search": False, "length_penalty": 1.0, "include_stop_str_in_output": False,
    "spaces_between_special_tokens": True, "truncate_prompt_tokens": None,
    "prompt_logprobs": None, "allowed_token_ids": None, "bad_words": [],
    "guided_whitespace_pattern": None, "structural_tag": None, "logits_processors": None,
    "return_tokens_as_token_ids": False, "cache_salt": None, "kv_transfer_params": None,
    "vllm_xargs": None, "priority": 0,
    # SGLang
    "stop_regex": None, "no_stop_trim": False, "lora_path": None, "session_params": None,
    "custom_params": None, "custom_logit_processor": None, "return_hidden_states": False,
    # OpenAI
    "audio": None, "prediction": None, "web_search_options": None, "modalities": ["text"],
}
UNSERVED: dict[type, dict[str, Any]] = {
    P.CompletionRequest: {**_OPENAI_UNSERVED, "add_special_tokens": True},
    P.ChatCompletionRequest: {
        **_OPENAI_UNSERVED, "add_generation_prompt": True, "continue_final_message": False,
        "add_special_tokens": False, "documents": None, "chat_template": None,
        "chat_template_kwargs": None, "mm_processor_kwargs": None, "echo": False,
        "functions": None, "function_call": None},
    P.StreamOptions: {"continuous_usage_stats": False},
    StructuredOutputs: {"structural_tag": None, "whitespace_pattern": None,
                        "disable_additional_properties": False},
    P.GenerateRequest: {
        "return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0,
        "token_ids_logprob": None, "return_text_in_logprobs": False, "input_embeds": None,
        "image_data": None, "audio_data": None, "video_data": None, "return_hidden_states": False,
        "lora_path": None, "session_params": None, "custom_logit_processor": None},
    P.NativeSamplingParams: {"stop_regex": None, "structural_tag": None, "no_stop_trim": False,
                             "spaces_between_special_tokens": True, "custom_params": None},
}


def screen(req: Strict) -> list[str]:
    """Refuse the known but unserved fields that ask for something (400 naming the first);
    return the paths of the fields ignored (``messages.0.refusal``), in the order sent."""
    ignored: list[str] = []

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, list):
            for i, x in enumerate(obj):
                walk(x, f"{path}{i}.")
            return
        if not isinstance(obj, Strict):
            return
        known = UNSERVED.get(type(obj), {})
        for k, v in obj.extra_fields().items():
            if k not in known:
                ignored.append(path + k)
            elif v is not None and not _same(v, known[k]):
                raise APIError(f"{path + k} is not supported by this server (send it as "
                               f"{json.dumps(known[k])} or leave it out)", param=path + k,
                               code="unsupported")
        for name in type(obj).model_fields:
            walk(getattr(obj, name), f"{path}{name}.")

    walk(req, "")
    return ignored


def _same(v: Any, default: Any) -> bool:
    return type(v) is type(default) and v == default or (
        isinstance(v, (int, float)) and not isinstance(v, bool)
        and isinstance(default, float) and v == default)


def ignored_header(paths: list[str], limit: int = 20) -> str:
    """The header's value: the names (quoted as JSON when not plain ASCII words, so nothing a
    client sends can break the header), at most ``limit`` of them."""
    names = [p if re.fullmatch(r"[\w.\-]{1,64}", p, re.ASCII) else json.dumps(p[:64])
             for p in paths[:limit]]
    more = f", ... ({len(paths) - limit} more)" if len(paths) > limit else ""
    return ", ".join(names) + more


def engine_fields(req: Strict, max_new: int, vocab_size: int | None, prefix: str = "") -> dict:
    """Engine sampling parameters for min_tokens, logit_bias, skip_special_tokens and the
    structured outputs, set only when they ask for something. ``prefix``: where the fields sit
    in the body (``sampling_params.`` for /generate), for the 400s' ``param``."""
    sp: dict = {}
    name = "min_new_tokens" if hasattr(req, "min_new_tokens") else "min_tokens"
    min_tokens = getattr(req, name, 0)
    if min_tokens:
        if min_tokens > max_new:
            raise APIError(f"{prefix}{name}={min_tokens} exceeds the tokens to generate "
                           f"({max_new})", param=prefix + name)
        sp["min_tokens"] = min_tokens
    bias = getattr(req, "logit_bias", None)
    if bias:
        ids = {int(k): v for k, v in bias.items()}
        past = [i for i in ids if vocab_size and i >= vocab_size]
        if past:
            raise APIError(f"{prefix}logit_bias names token {past[0]}, past the vocabulary "
                           f"({vocab_size} tokens)", param=prefix + "logit_bias")
        if len(ids) < len(bias):
            raise APIError(f"{prefix}logit_bias names a token twice", param=prefix + "logit_bias")
        sp["logit_bias"] = ids
    if not getattr(req, "skip_special_tokens", True):
        sp["skip_special_tokens"] = False
    sp.update(_constraint(req, prefix))
    return sp


# (field, what it gives) of the structured outputs; the first sent wins, a second is refused
_CONSTRAINTS = (("json_schema", "json_schema"), ("regex", "regex"), ("ebnf", "ebnf"),
                ("guided_json", "json_schema"), ("guided_regex", "regex"),
                ("guided_choice", "choice"), ("guided_grammar", "ebnf"))
_SO = (("json_", "json", "json_schema"), ("regex", "regex", "regex"),
       ("choice", "choice", "choice"), ("grammar", "grammar", "ebnf"))


def _constraint(req: Strict, prefix: str) -> dict:
    found = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", "json_object", True))
    elif rf is not None and rf.type == "json_schema":
        found.append(("response_format.json_schema.schema", "json_schema", rf.json_schema.schema_))
    found += [(f, kind, getattr(req, f)) for f, kind in _CONSTRAINTS
              if getattr(req, f, None) is not None]
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        found += [(f"structured_outputs.{name}", kind, getattr(so, attr))
                  for attr, name, kind in _SO if getattr(so, attr) is not None]
        if so.json_object:
            found.append(("structured_outputs.json_object", "json_object", True))
    choice = getattr(req, "tool_choice", None)
    if choice not in (None, "none", "auto") and getattr(req, "tools", None):
        found.append(("tool_choice", "tools", None))  # a forced call has its own grammar
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise APIError(f"{prefix}{first} and {prefix}{second} both constrain the output; send one "
                       "of them", param=prefix + second)
    if not found or found[0][1] == "tools":
        return {}
    field, kind, value = found[0]
    param = prefix + field
    if kind == "json_object":
        return {"json_object": True}
    if kind == "choice":
        return {"ebnf": _check_grammar("ebnf", choice_grammar(value), param)}
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise APIError(f"{param}: not valid JSON: {e}", param=param) from None
        if not isinstance(value, dict):
            raise APIError(f"{param}: a JSON schema is an object", param=param)
        value = json.dumps(value)
    return {kind: _check_grammar(kind, value, param)}


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices``."""
    def lit(s: str) -> str:
        out = "".join("\\" + c if c in '"\\' else f"\\u{ord(c):04x}" if ord(c) < 0x20 or c == "\x7f"
                      else c for c in s)
        return f'"{out}"'
    return "root ::= " + " | ".join(lit(c) for c in choices)


def _check_grammar(kind: str, text: str, param: str) -> str:
    """Refuse what the engine could not compile, naming the field, before the request reaches
    the engine (parsing needs no vocabulary)."""
    try:
        import xgrammar as xgr
    except Exception:
        raise APIError(f"{param} needs constrained decoding, and the xgrammar package is not "
                       "installed", param=param, code="unsupported") from None
    from doublesparse.engine.grammar import grammar_error

    build = {"json_schema": lambda t: xgr.Grammar.from_json_schema(t, any_whitespace=False),
             "regex": xgr.Grammar.from_regex, "ebnf": xgr.Grammar.from_ebnf}[kind]
    try:
        build(text)
    except Exception as e:
        what = {"json_schema": "JSON schema", "regex": "regular expression",
                "ebnf": "EBNF grammar"}[kind]
        raise APIError(f"{param}: the {what} is not usable: {grammar_error(e)}",
                       param=param) from None
    return text


def note_ignored(request, paths: list[str]) -> None:
    """Log the ignored fields and leave them for the response's header (FrontDoor adds it)."""
    if not paths:
        return
    request.scope.setdefault("state", {})["ignored_fields"] = ignored_header(paths)
    log.warning("%s %s: ignored fields this server does not know: %s", request.method,
                request.url.path, ignored_header(paths))
