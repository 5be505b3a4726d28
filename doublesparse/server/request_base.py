"""The base of every request schema, and the request fields beyond the core sampling ones that
both OpenAI endpoints share: logit_bias, min_tokens, skip_special_tokens and the structured
outputs of SGLang and vLLM.

The base is strict (no "5" -> 5 coercion) and keeps the fields a model does not declare aside
(``extra_fields``) instead of dropping them unseen: :mod:`doublesparse.server.fields` refuses
those this server knows but does not serve and reports the others as ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

# OpenAI's range: -100 bans a token, +100 all but forces it
BIAS = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
# A grammar or pattern: compiled per request, so an empty one is refused up front
GRAMMAR_TEXT = Field(None, min_length=1)


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    _extra: dict = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_extra(cls, data, handler):
        m = handler(data)
        if isinstance(data, dict) and isinstance(m, Strict):
            names = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            m._extra = {k: v for k, v in data.items() if k not in names}
        return m

    def extra_fields(self) -> dict:
        """The fields the client sent that this model does not declare (name -> raw value)."""
        return self._extra


def logit_bias_keys(v: dict | None) -> dict | None:
    for k in v or {}:
        if not (k.isascii() and k.isdigit() and len(k) <= 18):
            raise ValueError(f"keys must be token ids (decimal integers), got {k!r}")
    return v


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs`` object (the successor of its ``guided_*`` fields)."""

    json_: Union[str, dict[str, Any], None] = Field(None, alias="json")
    regex: str | None = GRAMMAR_TEXT
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = GRAMMAR_TEXT
    json_object: bool | None = None


class OutputFields(Strict):
    """logit_bias ({token id: bias}), min_tokens, skip_special_tokens, and the structured outputs
    besides response_format: SGLang's names, then vLLM's (at most one constraint in all)."""

    logit_bias: dict[str, BIAS] | None = None
    min_tokens: int = Field(0, ge=0, le=2**63 - 1)
    skip_special_tokens: bool = True
    json_schema: str | None = GRAMMAR_TEXT
    regex: str | None = GRAMMAR_TEXT
    ebnf: str | None = GRAMMAR_TEXT
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: str | None = GRAMMAR_TEXT
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = GRAMMAR_TEXT
    structured_outputs: StructuredOutputs | None = None

    _check_bias = field_validator("logit_bias")(logit_bias_keys)
