"""Request schemas and OpenAI-style errors.

Validation is strict (no "5" -> 5 coercion) so wrong types are refused instead of guessed at, and
every failure becomes ``{"error": {"message", "type", "param", "code"}}`` with the offending
field in ``param``. Fields no model here declares are kept aside (``extra_fields``), so that
:mod:`doublesparse.server.fields` can refuse the ones this server knows but does not serve and
report the others as ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError, field_validator

from doublesparse.engine.sampling_params import (LOGPROBS_MAX, REPETITION_PENALTY_MIN, TOP_K_MAX,
                                                 TOP_P_MIN)
from doublesparse.server.request_base import BIAS, GRAMMAR_TEXT, OutputFields, logit_bias_keys
from doublesparse.server.request_base import Strict as _Strict

# Bounds are what the engine can represent (float32 sampling, int64 ids and counts), so nothing
# that passes here can fail later inside a batched step. Floats refuse NaN and infinities.
_I64 = 2**63 - 1
_TEMPERATURE = dict(ge=0.0, le=2.0, allow_inf_nan=False)
_TOP_P = dict(gt=0.0, le=1.0, allow_inf_nan=False)
_TOP_K = dict(ge=-1, le=TOP_K_MAX)
_PENALTY = dict(ge=-2.0, le=2.0, allow_inf_nan=False)
# Samples per request (n, best_of): each is a request of its own in the engine.
N_MAX = 128


class APIError(Exception):
    """An error that maps one-to-one onto an HTTP response with an OpenAI-style body."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self, extra_headers: dict[str, str] | None = None) -> JSONResponse:
        headers = {**self.headers, **(extra_headers or {})}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def from_validation_error(e: ValidationError) -> APIError:
    """Report the first problem only: one precise message beats a wall of them."""
    err = e.errors()[0]
    loc = ".".join(str(p) for p in _field_path(err.get("loc", ())))
    if err["type"] == "json_invalid":
        return APIError(f"request body is not valid JSON: {err['msg']}", code="invalid_json")
    if err["type"] == "model_type" and not loc:
        return APIError("request body must be a JSON object", code="invalid_json")
    msg = f"{loc}: {err['msg']}" if loc else err["msg"]
    return APIError(msg, param=loc or None, code="invalid_value" if loc else None)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _field_path(loc: tuple) -> list:
    """Drop the union-member tags pydantic appends (``prompt.str``, ``content.list[TextPart]``):
    clients want the field they sent, not our type internals."""
    out = []
    for p in loc:
        if isinstance(p, str) and ("[" in p or p in _TYPE_TAGS or p[:1].isupper()
                                   or p.startswith("function-")):
            break
        out.append(p)
    return out


def _top_p_float32(v: float) -> float:
    if v < TOP_P_MIN:
        raise ValueError(f"must be at least {TOP_P_MIN:.3g}: smaller values round to 0 in float32")
    return v


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(OutputFields):
    """Sampling fields shared by both OpenAI endpoints (OpenAI names plus SGLang/vLLM extensions)."""

    model: str | None = None
    max_tokens: int | None = Field(None, le=_I64)
    temperature: float = Field(1.0, **_TEMPERATURE)
    top_p: float = Field(1.0, **_TOP_P)
    top_k: int = Field(-1, **_TOP_K)
    n: int = Field(1, ge=1, le=N_MAX)
    seed: int | None = Field(None, ge=-_I64, le=_I64)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, **_PENALTY)
    frequency_penalty: float = Field(0.0, **_PENALTY)
    # below the minimum, float32 sampling overflows (see sampling_params)
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_MIN, le=10.0, allow_inf_nan=False)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    response_format: ResponseFormat | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=_I64)]] | None = None
    # Per-request Double Sparsity overrides (honoured only if the engine supports them).
    enable_double_sparsity: bool | None = None
    ds_heavy_token_num: int | None = Field(None, gt=0, le=_I64)

    _check_top_p = field_validator("top_p")(_top_p_float32)


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=LOGPROBS_MAX)
    best_of: int | None = Field(None, ge=1, le=N_MAX)
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=LOGPROBS_MAX)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True


class NativeSamplingParams(_Strict):
    """SGLang's ``sampling_params`` object of ``/generate``."""

    max_new_tokens: int = Field(128, le=_I64)
    temperature: float = Field(1.0, **_TEMPERATURE)
    top_p: float = Field(1.0, **_TOP_P)
    top_k: int = Field(-1, **_TOP_K)
    seed: int | None = Field(None, ge=-_I64, le=_I64)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=_I64)]] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=_I64)
    enable_double_sparsity: bool | None = None
    ds_heavy_token_num: int | None = Field(None, gt=0, le=_I64)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_MIN, le=10.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, **_PENALTY)
    presence_penalty: float = Field(0.0, **_PENALTY)
    min_new_tokens: int = Field(0, ge=0, le=_I64)
    logit_bias: dict[str, BIAS] | None = None
    skip_special_tokens: bool = True
    json_schema: str | None = GRAMMAR_TEXT
    regex: str | None = GRAMMAR_TEXT
    ebnf: str | None = GRAMMAR_TEXT

    _check_top_p = field_validator("top_p")(_top_p_float32)
    _check_bias = field_validator("logit_bias")(logit_bias_keys)


class GenerateRequest(_Strict):
    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: str | None = None
    return_ds_stats: bool = False  # meta_info.ds_stats: decode steps and sampled attention recall


def parse(model: type[BaseModel], raw: bytes) -> BaseModel:
    try:
        return model.model_validate_json(raw or b"")
    except ValidationError as e:
        raise from_validation_error(e) from None


def unsupported(req: BaseModel) -> None:
    """Refuse features the engine does not implement, and combinations that cannot be honoured,
    instead of silently ignoring them."""
    if getattr(req, "suffix", None):
        raise APIError("suffix (insertion) is not supported", param="suffix", code="unsupported")
    best_of = getattr(req, "best_of", None)
    if best_of is not None:
        if best_of < req.n:
            raise APIError(f"best_of ({best_of}) must be at least n ({req.n})", param="best_of")
        if best_of > req.n and req.stream:
            raise APIError("best_of > n cannot be streamed", param="best_of")
    if getattr(req, "top_logprobs", None) is not None and not getattr(req, "logprobs", False):
        raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
    choice = getattr(req, "tool_choice", None)
    if choice is not None and choice != "none" and not getattr(req, "tools", None):
        raise APIError("tool_choice needs tools", param="tool_choice")
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_schema" and (rf.json_schema is None
                                                        or rf.json_schema.schema_ is None):
        raise APIError("response_format json_schema needs json_schema.schema",
                       param="response_format.json_schema")
    if rf is not None and rf.type != "text" and choice not in (None, "none", "auto"):
        raise APIError("response_format and a forced tool_choice both constrain the output; "
                       "send one of them", param="response_format")


def sampling_extras(req: BaseModel) -> dict:
    """Engine sampling parameters for the penalties, min_p and logprobs, set only when they
    differ from the defaults (so engines without them still serve the rest). response_format
    and the other structured outputs: :func:`doublesparse.server.fields.engine_fields`."""
    sp = {}
    for f, off in (("min_p", 0.0), ("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                   ("presence_penalty", 0.0)):
        if getattr(req, f, off) != off:
            sp[f] = getattr(req, f)
    lp = getattr(req, "logprobs", None)
    if isinstance(lp, bool):  # chat: a flag plus top_logprobs
        lp = (req.top_logprobs or 0) if lp else None
    if lp is not None:
        sp["logprobs"] = lp
    return sp


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > 16:
        raise APIError("at most 16 stop sequences are allowed", param="stop")
    return [s for s in stops if s]
