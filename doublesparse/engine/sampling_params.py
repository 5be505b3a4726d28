"""Per-request sampling parameters (validated at construction)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    temperature: 0 = greedy. top_p in (0, 1]. top_k: <= 0 or None = off. max_new_tokens >= 1.
    stop: strings ending generation (not included in the text). stop_token_ids: extra ids that end
    generation (the model's EOS ids too, unless ignore_eos). seed: per-request sampling seed
    (None: derived from the engine seed and the request's arrival order).
    enable_double_sparsity / ds_heavy_token_num: per-request overrides are only accepted when they
    agree with the engine (the decode kernels take one top-k per batch); otherwise ValueError.
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

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        ids = () if self.stop_token_ids is None else tuple(int(i) for i in self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) \
                or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        try:
            t = float(self.temperature)
        except (TypeError, ValueError):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}") from None
        if not t >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        try:
            p = float(self.top_p)
        except (TypeError, ValueError):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}") from None
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool)):
            raise ValueError(f"top_k must be an integer (<= 0 disables it), got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.ds_heavy_token_num is not None and (not isinstance(self.ds_heavy_token_num, int)
                                                    or self.ds_heavy_token_num <= 0):
            raise ValueError(f"ds_heavy_token_num must be an integer >= 1, got {self.ds_heavy_token_num!r}")

    @property
    def greedy(self) -> bool:
        return float(self.temperature) == 0.0 or self.top_k == 1

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


__all__ = ["SamplingParams"]
