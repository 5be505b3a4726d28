"""What the scheduler hands the engine each step (:class:`StepPlan` and its parts) and what it
keeps of each request (:class:`SchedRequest`). Plain Python; the policy is
:mod:`doublesparse.engine.scheduler`'s."""

from __future__ import annotations

from dataclasses import dataclass


class RequestRefused(ValueError):
    """The request can never be served by this engine (too long for the pool or the context)."""


@dataclass
class SchedRequest:
    rid: str
    prompt_len: int
    max_new_tokens: int
    prompt_ids: list | None = None  # token ids: needed for the prefix cache (None: not cached)
    num_prefilled: int = 0      # prompt tokens handed to prefill so far (or matched in the cache)
    state: str = "waiting"      # waiting -> prefill -> decode
    cached: int = 0             # leading tokens held for it in the prefix cache (locked)
    node: object = None         # the cache node ending its locked prefix
    group: str = ""             # fair-admission group (its client request); "" -> its own rid

    @property
    def reserve(self) -> int:
        return self.prompt_len + self.max_new_tokens


@dataclass(frozen=True)
class PrefillChunk:
    """Compute prompt tokens ``[start, end)`` of ``rid``; ``last``: the prompt ends here, so the
    engine samples the first output token from this chunk's last position."""

    rid: str
    start: int
    end: int
    last: bool

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class PrefixHit:
    """Admitted request ``rid`` starts from ``num_tokens`` cached tokens, whose slots are the
    concatenation of ``values`` (cache node values, in order)."""

    rid: str
    num_tokens: int
    values: tuple


@dataclass(frozen=True)
class PrefixRemap:
    """Row positions ``[start, stop)`` of a request hold duplicates of cached slots; the cached
    ones are ``concat(values)[start:stop]`` (``values``: node values from position 0)."""

    start: int
    stop: int
    values: tuple


@dataclass(frozen=True)
class StepPlan:
    prefill: tuple[PrefillChunk, ...] = ()
    decode: tuple[str, ...] = ()
    admitted: tuple[str, ...] = ()   # rids that got KV reserved this step (engine gives them a row)
    prefix_hits: tuple[PrefixHit, ...] = ()
    evicted: tuple = ()              # values of cache nodes evicted this step: the engine frees them

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefill)
