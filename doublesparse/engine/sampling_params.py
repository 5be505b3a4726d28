"""Per-request sampling parameters (validated at construction).

Validation checks what the sampler can represent, not only what makes sense: the sampler works in
float32 and int64, so a top_p that rounds to 0 in float32 or a top_k past int64 would otherwise
pass here and fail inside a batched step, taking the other requests of the batch with it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

# Largest top_k kept as given; no vocabulary comes near it, so a larger one means "off".
TOP_K_MAX = 2**31 - 1
# Smallest top_p whose float32 value is not 0 (the sampler's arithmetic is float32).
TOP_P_MIN = float(np.finfo(np.float32).tiny)
# Repetition penalties outside [1e-6, 1e6] are refused: the sampler divides a seen token's logit by
# the penalty and then by the temperature (clamped at 1e-6), and below ~1e-30 that overflows float32
# for ordinary logits (5e-38 gave inf - inf = NaN probabilities); 1e6 keeps the same margin on the
# multiplying side. Far beyond any useful penalty (HF and vLLM users stay within 0.5-2).
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 1e-6, 1e6
# Seeds are reduced to 48 bits for torch.Generator; beyond int64 they are refused.
_INT64_MAX = 2**63 - 1
# Most alternatives per token that logprobs may ask for (OpenAI's top_logprobs limit).
LOGPROBS_MAX = 20


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    temperature: 0 = greedy. top_p in (0, 1]. top_k: <= 0 or None = off. max_new_tokens >= 0
    (0: prefill only, nothing sampled; the request ends with finish_reason "length").
    stop: strings ending generation (not included in the text). stop_token_ids: extra ids that end
    generation (the model's EOS ids too, unless ignore_eos). seed: per-request sampling seed
    (None: derived from the engine seed and the request's arrival order).
    enable_double_sparsity / ds_heavy_token_num: per-request overrides are only accepted when they
    agree with the engine (the decode kernels take one top-k per batch); otherwise ValueError.
    min_p in [0, 1]: drop tokens less likely than min_p times the most likely one (after
    temperature). repetition_penalty in [1e-6, 1e6] (1 = off): logits of tokens seen in the prompt or output
    are divided by it when positive, multiplied when negative (HF/vLLM). frequency_penalty /
    presence_penalty in [-2, 2] (0 = off): subtract count * frequency + (count > 0) * presence
    from the logits of output tokens (OpenAI). logprobs: None = off; k in [0, 20] returns the
    sampled token's log-probability and the k most likely alternatives, from the model's own
    distribution (raw logits: before penalties, temperature, filtering and grammar masks).
    json_schema / ebnf / regex / json_object: constrain the output to a JSON schema (a JSON
    string), an EBNF grammar (xgrammar's dialect), a regular expression, or any JSON object that
    closes within max_new_tokens (:mod:`json_object`); at most one of them.
    min_tokens in [0, max_new_tokens]: the stop token ids (EOS unless ignore_eos, and
    stop_token_ids) cannot be sampled, and stop strings do not match, until min_tokens tokens were
    generated (vLLM's rule); a grammar that allows nothing but its end still ends.
    logit_bias: {token id: bias in [-100, 100]} (or the pairs) added to the logits before
    penalties, masks and sampling (OpenAI); kept as sorted (id, bias) pairs.
    return_ds_stats: the finished request's meta carries ``ds_stats`` (its decode steps, sparse
    ones, and the sampled attention recall of its rows: attention/recall.py).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    enable_double_sparsity: bool | None = None
    ds_heavy_token_num: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    regex: str | None = None
    json_object: bool = False
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    return_ds_stats: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        ids = () if self.stop_token_ids is None else tuple(int(i) for i in self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", ids)
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if self.max_new_tokens > _INT64_MAX:
            raise ValueError(f"max_new_tokens must be at most {_INT64_MAX}, got {self.max_new_tokens!r}")
        t = _finite(self.temperature, "temperature", "a finite number >= 0")
        if t < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        p = _finite(self.top_p, "top_p", "a finite number in (0, 1]")
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if p < TOP_P_MIN:
            raise ValueError(f"top_p must be at least {TOP_P_MIN:.3g} (it rounds to 0 in float32), "
                             f"got {self.top_p!r}")
        if self.top_k is not None:
            if not _is_int(self.top_k):
                raise ValueError(f"top_k must be an integer (<= 0 disables it), got {self.top_k!r}")
            if not -_INT64_MAX <= self.top_k <= TOP_K_MAX:
                raise ValueError(f"top_k must be at most {TOP_K_MAX} (<= 0 disables it), got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if self.seed is not None and (not _is_int(self.seed) or abs(self.seed) > _INT64_MAX):
            raise ValueError(f"seed must be an integer within int64, got {self.seed!r}")
        if any(abs(i) > _INT64_MAX for i in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be within int64, got {self.stop_token_ids!r}")
        if self.ds_heavy_token_num is not None and (not _is_int(self.ds_heavy_token_num)
                                                    or self.ds_heavy_token_num <= 0):
            raise ValueError(f"ds_heavy_token_num must be an integer >= 1, got {self.ds_heavy_token_num!r}")
        self._check_extras()

    def _check_extras(self) -> None:
        if not isinstance(self.return_ds_stats, bool):
            raise ValueError(f"return_ds_stats must be true or false, got {self.return_ds_stats!r}")
        if not 0.0 <= _finite(self.min_p, "min_p", "a finite number in [0, 1]") <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        rp = _finite(self.repetition_penalty, "repetition_penalty", "a finite number > 0")
        if not REPETITION_PENALTY_MIN <= rp <= REPETITION_PENALTY_MAX:
            raise ValueError(f"repetition_penalty must be in [{REPETITION_PENALTY_MIN:g}, "
                             f"{REPETITION_PENALTY_MAX:g}] (float32 overflows beyond), "
                             f"got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not -2.0 <= _finite(v, name, "a finite number in [-2, 2]") <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= LOGPROBS_MAX):
                raise ValueError(f"{name} must be an integer in [0, {LOGPROBS_MAX}], got {v!r}")
        for name in ("json_schema", "ebnf", "regex"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ValueError(f"{name} must be a non-empty string, got {v!r}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        given = [n for n in ("json_schema", "ebnf", "regex") if getattr(self, n) is not None]
        if len(given) + self.json_object > 1:
            raise ValueError("give at most one of json_schema, ebnf, regex and json_object")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_new_tokens="
                             f"{self.max_new_tokens}], got {self.min_tokens!r}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        # numbers given as numeric strings ("0.5", as pydantic's lax mode takes them) are kept as
        # floats, so the sampler's comparisons and tensors never see a str
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return float(self.temperature) == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens seen so far (any penalty is on)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def constrained(self) -> bool:
        return (self.json_schema is not None or self.ebnf is not None or self.regex is not None
                or self.json_object)

    @classmethod
    def from_any(cls, x: "SamplingParams | dict | None") -> "SamplingParams":
        if x is None:
            return cls()
        if isinstance(x, cls):
            return x
        if isinstance(x, dict):
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(x) - names)
            if unknown:
                raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(names)}")
            return cls(**{k: v for k, v in x.items() if v is not None or k in ("top_k", "seed")})
        raise ValueError(f"sampling_params must be a SamplingParams or a dict, got {type(x).__name__}")


def _logit_bias(x) -> tuple[tuple[int, float], ...]:
    """{id: bias} or (id, bias) pairs -> sorted pairs; ids are ints >= 0 (or their decimal
    strings, as JSON keys are), biases finite in [-100, 100]."""
    if x is None:
        return ()
    try:
        pairs = list(x.items()) if isinstance(x, dict) else [tuple(p) for p in x]
    except TypeError:
        raise ValueError(f"logit_bias must map token ids to biases, got {x!r}") from None
    out = {}
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"logit_bias must map token ids to biases, got {x!r}")
        k, v = pair
        tid = int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else k
        if not _is_int(tid) or not 0 <= tid <= _INT64_MAX:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}")
        if tid in out:
            raise ValueError(f"logit_bias names token {tid} twice")
        b = _finite(v, "logit_bias", "a finite number in [-100, 100] per token")
        if not -100.0 <= b <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {v!r}")
        out[tid] = b
    return tuple(sorted(out.items()))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x, name: str, what: str) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be {what}, got {x!r}") from None
    if isinstance(x, bool) or not math.isfinite(v):
        raise ValueError(f"{name} must be {what}, got {x!r}")
    return v


__all__ = ["LOGPROBS_MAX", "REPETITION_PENALTY_MAX", "REPETITION_PENALTY_MIN", "SamplingParams",
           "TOP_K_MAX", "TOP_P_MIN"]
