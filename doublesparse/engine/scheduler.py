"""Continuous-batching scheduler. Plain Python (no torch): it decides, the engine executes.

Policy
  * Admission is FCFS and reserves ``prompt_len + max_new_tokens`` KV tokens up front, so a running
    request can never run out of cache mid-decode (no preemption needed). A request that can never
    fit (pool or context too small) is refused at ``add``; one that does not fit *now* waits, and
    requests behind it wait too (no overtaking, so a big request is not starved).
  * ``prefill_schedule="interleave"`` (default): every step does up to two forwards, a prefill
    forward over at most ``chunked_prefill_size`` prompt tokens (the chunked request in progress
    first, then newly admitted ones) and a decode forward over every request that had finished its
    prefill *before* this step. New requests join between decode steps and long prompts do not
    stall running decodes, but every running decode step then also waits for a prefill chunk.
  * ``prefill_schedule="cohort"`` (TGI-style batched prefill): while any prompt work other than a
    last prompt token is left (of running requests, or of waiting ones that fit now), steps are
    prefill-only, same budget, same FCFS admission, each prompt held back at its last token. When
    none is left, one step computes the held-back last tokens of all of them (their first output
    tokens) together with the running decodes, and from then on they decode with no prefill in
    their steps. Requests that arrive together get their first token together; decodes stop
    while a cohort prefills. Higher time to first token, lower and steadier time per output token.
  * ``finish`` (done or aborted) releases the reservation at once.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from ..config import SchedulerConfig


class RequestRefused(ValueError):
    """The request can never be served by this engine (too long for the pool or the context)."""


@dataclass
class SchedRequest:
    rid: str
    prompt_len: int
    max_new_tokens: int
    num_prefilled: int = 0      # prompt tokens handed to prefill so far
    state: str = "waiting"      # waiting -> prefill -> decode

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
class StepPlan:
    prefill: tuple[PrefillChunk, ...] = ()
    decode: tuple[str, ...] = ()
    admitted: tuple[str, ...] = ()   # rids that got KV reserved this step (engine gives them a row)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefill)


class Scheduler:
    def __init__(self, config: SchedulerConfig, token_capacity: int, max_context_len: int):
        """token_capacity: KV slots in the pool; max_context_len: longest sequence (positions)."""
        self.config = config
        self.token_capacity = int(token_capacity)
        self.max_context_len = int(max_context_len)
        self.waiting: deque[SchedRequest] = deque()
        self.running: OrderedDict[str, SchedRequest] = OrderedDict()
        self.reserved_tokens = 0

    # ---------------------------------------------------------------------------- admission
    def check(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise RequestRefused if such a request could never run."""
        if prompt_len <= 0:
            raise RequestRefused("the prompt is empty (0 tokens)")
        if max_new_tokens <= 0:
            raise RequestRefused(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        need = prompt_len + max_new_tokens
        if need > self.max_context_len:
            raise RequestRefused(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds "
                f"the maximum context length {self.max_context_len}; shorten the prompt or lower "
                "max_new_tokens")
        if need > self.token_capacity:
            raise RequestRefused(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds "
                f"the KV pool ({self.token_capacity} tokens); raise --max-total-tokens / "
                "--mem-fraction-static or shorten the request")

    def add(self, rid: str, prompt_len: int, max_new_tokens: int) -> None:
        if rid in self.running or any(r.rid == rid for r in self.waiting):
            raise ValueError(f"request id {rid!r} is already scheduled")
        self.check(prompt_len, max_new_tokens)
        self.waiting.append(SchedRequest(rid, int(prompt_len), int(max_new_tokens)))

    @property
    def free_tokens(self) -> int:
        return self.token_capacity - self.reserved_tokens

    # ----------------------------------------------------------------------------- schedule
    def schedule(self) -> StepPlan:
        """Decide the next step. State advances as if the engine executes the plan."""
        decode = tuple(r.rid for r in self.running.values() if r.state == "decode")
        budget = self.config.chunked_prefill_size
        chunks: list[PrefillChunk] = []
        admitted: list[str] = []
        # cohort: while work other than last prompt tokens is left, hold every prompt back at its
        # last token and skip the decodes; else compute the held-back tokens with the decodes
        hold = self.config.prefill_schedule == "cohort" and self._cohort_work_left()

        def take(r: SchedRequest) -> None:
            nonlocal budget
            n = min(budget, r.prompt_len - int(hold) - r.num_prefilled)
            if n <= 0:      # only the held-back last token left (or a 1-token prompt)
                return
            start = r.num_prefilled
            r.num_prefilled += n
            budget -= n
            last = r.num_prefilled == r.prompt_len
            chunks.append(PrefillChunk(r.rid, start, start + n, last))
            if last:
                r.state = "decode"   # decodes from the next step on

        for r in self.running.values():
            if budget <= 0:
                break
            if r.state == "prefill":
                take(r)
        while budget > 0 and self.waiting and self._fits(self.waiting[0]):
            r = self.waiting.popleft()
            r.state = "prefill"
            self.running[r.rid] = r
            self.reserved_tokens += r.reserve
            admitted.append(r.rid)
            take(r)
        return StepPlan(tuple(chunks), () if hold else decode, tuple(admitted))

    def cohort_release_next(self) -> bool:
        """Whether the next plan (cohort schedule) is a release: prompts are held back at their
        last token and no other prompt work is left."""
        return (self.config.prefill_schedule == "cohort"
                and any(r.state == "prefill" for r in self.running.values())
                and not self._cohort_work_left())

    def _fits(self, r: SchedRequest, extra_running: int = 0, extra_tokens: int = 0) -> bool:
        """Whether waiting request ``r`` can be admitted now (after ``extra_*`` more admissions)."""
        return (len(self.running) + extra_running < self.config.max_running_requests
                and r.reserve + extra_tokens <= self.free_tokens)

    def _cohort_work_left(self) -> bool:
        """Prompt work other than last tokens: of a running request, or of a waiting one that the
        FCFS admission would take now. One that does not fit now does not count, so a full pool
        cannot keep the decodes from running (which is what frees it)."""
        if any(r.state == "prefill" and r.num_prefilled < r.prompt_len - 1
               for r in self.running.values()):
            return True
        n = tokens = 0
        for w in self.waiting:
            if not self._fits(w, n, tokens):
                return False
            if w.prompt_len > 1:
                return True
            n, tokens = n + 1, tokens + w.reserve
        return False

    # ------------------------------------------------------------------------------- finish
    def finish(self, rid: str) -> str | None:
        """Drop a finished or aborted request; returns the state it was in (None if unknown)."""
        r = self.running.pop(rid, None)
        if r is not None:
            self.reserved_tokens -= r.reserve
            return r.state
        for i, w in enumerate(self.waiting):
            if w.rid == rid:
                del self.waiting[i]
                return "waiting"
        return None

    # -------------------------------------------------------------------------------- stats
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
