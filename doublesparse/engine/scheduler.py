"""Continuous-batching scheduler. Plain Python (no torch): it decides, the engine executes.

Policy
  * Admission is fair across groups (the siblings of one fanned-out client request share a group;
    :class:`FairQueue`): round robin over groups, FCFS within one, so one
    request's thousands of siblings cannot starve a request that arrives behind them. With one
    request per group it is FCFS. While any request runs, the last free running slot goes only to
    a group with nothing running, so a newcomer is admitted at once rather than after a sibling
    finishes (a lone fan-out runs at most ``max_running_requests - 1`` at a time).
  * Admission reserves ``prompt_len + max_new_tokens`` KV tokens up front, so a running
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

Prefix cache (on unless ``disable_radix_cache``; :mod:`doublesparse.engine.radix_cache`)
  * Admission matches the longest cached prefix of the prompt (at most ``prompt_len - 1`` tokens:
    the last one is always computed, for its logits), locks it and prefills only the rest; the
    matched tokens are not reserved again. A request reserves ``reserve - cached`` private slots;
    admission needs them free, where cache nodes no running request holds count as free: the
    least-recently-used ones are evicted (``StepPlan.evicted``) when the pool needs their slots.
    Invariant: ``cache.total_size + reserved_tokens <= token_capacity``, so allocation never fails.
  * Only tokens whose K/V are computed (launched in an earlier step) are matched: after every
    prefill chunk the engine caches the request's prompt so far (``cache_prefill``), and a later
    request with the same prefix (an n > 1 sibling, the next question on a document) matches it
    from the next step on. A request admitted in the same step computes its own copy; the copy
    that reaches the cache second is deduplicated (the engine frees its slots and points the
    request at the cached ones).
  * A finished request leaves its prompt and output (the tokens with K/V) in the cache.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Callable, Generic, Iterator, TypeVar

from ..config import SchedulerConfig
from .radix_cache import RadixCache
from .step_plan import PrefillChunk, PrefixHit, PrefixRemap, RequestRefused, SchedRequest, StepPlan

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Waiting requests in fair admission order. Plain Python.

    Requests carry a *group*: the client request they belong to (the ``n`` x ``best_of`` x prompts
    siblings of one OpenAI request share one; a plain request is a group of its own). Admission takes
    groups in round robin, and FCFS within a group: after one of a group's requests is admitted the
    group goes to the back of the line, so a request that arrives behind 16,384 siblings of another
    is next but one, not 16,385th. With one request per group this is plain FCFS.

    Every operation is O(1) (``remove`` by id too), so aborting a large fan-out, request by request,
    stays linear in its size.
    """

    def __init__(self) -> None:
        self._groups: OrderedDict[str, OrderedDict[str, T]] = OrderedDict()  # group -> rid -> item
        self._group_of: dict[str, str] = {}                                # rid -> group

    def add(self, rid: str, group: str, item: T) -> None:
        if rid in self._group_of:
            raise ValueError(f"request id {rid!r} is already waiting")
        self._group_of[rid] = group
        self._groups.setdefault(group, OrderedDict())[rid] = item  # a new group joins at the back

    def head(self, skip: Callable[[str], bool] | None = None) -> T | None:
        """The next request to admit: the first group's oldest (None when empty). ``skip(group)``
        True passes over that group for this pick (e.g. one that holds the last free slot's
        claim already)."""
        for g, items in self._groups.items():
            if skip is None or not skip(g):
                return next(iter(items.values()))
        return None

    def take(self, rid: str) -> T:
        """Remove ``rid`` for admission: its group goes to the back of the line."""
        g = self._group_of[rid]
        item = self.remove(rid)
        if g in self._groups:
            self._groups.move_to_end(g)
        return item

    def remove(self, rid: str) -> T:
        """Remove ``rid`` (aborted while waiting); the order of the others is unchanged."""
        g = self._group_of.pop(rid)
        items = self._groups[g]
        item = items.pop(rid)
        if not items:
            del self._groups[g]
        return item

    def get(self, rid: str) -> T | None:
        g = self._group_of.get(rid)
        return None if g is None else self._groups[g][rid]

    def __contains__(self, rid: object) -> bool:
        return rid in self._group_of

    def __len__(self) -> int:
        return len(self._group_of)

    def __bool__(self) -> bool:
        return bool(self._group_of)

    def __iter__(self) -> Iterator[T]:
        """Every waiting request in the order admission would take them (no skips)."""
        lanes = deque(iter(items.values()) for items in self._groups.values())
        while lanes:
            lane = lanes.popleft()
            for item in lane:
                yield item
                lanes.append(lane)
                break

    @property
    def num_groups(self) -> int:
        return len(self._groups)


class Scheduler:
    def __init__(self, config: SchedulerConfig, token_capacity: int, max_context_len: int):
        """token_capacity: KV slots in the pool; max_context_len: longest sequence (positions)."""
        self.config = config
        self.token_capacity = int(token_capacity)
        self.max_context_len = int(max_context_len)
        self.waiting: FairQueue[SchedRequest] = FairQueue()
        self.running: OrderedDict[str, SchedRequest] = OrderedDict()
        self.group_running: Counter = Counter()  # group -> its running requests
        self.reserved_tokens = 0    # private slots promised to running requests (not in the cache)
        self.cache = None if config.disable_radix_cache else RadixCache()
        self.hit_tokens = 0         # prompt tokens admission found in the cache
        self.query_tokens = 0       # prompt tokens of admitted requests
        self.evicted_tokens = 0     # cached tokens evicted to make room

    # ---------------------------------------------------------------------------- admission
    def check(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise RequestRefused if such a request could never run."""
        if prompt_len <= 0:
            raise RequestRefused("the prompt is empty (0 tokens)")
        if max_new_tokens < 0:
            raise RequestRefused(f"max_new_tokens must be >= 0, got {max_new_tokens}")
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

    def add(self, rid: str, prompt_len: int, max_new_tokens: int, prompt_ids=None,
            group: str | None = None) -> None:
        """``prompt_ids``: the prompt's token ids, for the prefix cache (without them the request
        neither uses nor fills it). ``group``: its fair-admission group (None: a group of its own)."""
        if rid in self.running or rid in self.waiting:
            raise ValueError(f"request id {rid!r} is already scheduled")
        self.check(prompt_len, max_new_tokens)
        if prompt_ids is not None and len(prompt_ids) != prompt_len:
            raise ValueError(f"prompt_len {prompt_len} but {len(prompt_ids)} prompt ids")
        ids = list(prompt_ids) if prompt_ids is not None and self.cache is not None else None
        g = group or rid
        self.waiting.add(rid, g, SchedRequest(rid, int(prompt_len), int(max_new_tokens), ids, group=g))

    @property
    def cached_tokens(self) -> int:
        return self.cache.total_size if self.cache is not None else 0

    @property
    def evictable_tokens(self) -> int:
        return self.cache.evictable_size if self.cache is not None else 0

    @property
    def free_tokens(self) -> int:
        """Slots admission may promise: neither reserved nor held by a running request's prefix."""
        return self.token_capacity - self.reserved_tokens - self.cached_tokens + self.evictable_tokens

    def _peek(self, r: SchedRequest) -> tuple[int, int]:
        """(tokens of ``r``'s prompt admission would match, how many of them are evictable now)."""
        if r.prompt_ids is None:
            return 0, 0
        return self.cache.peek(r.prompt_ids[:r.prompt_len - 1])

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
        hits: list[PrefixHit] = []
        evicted: list = []
        while budget > 0 and self.waiting:
            r = self.waiting.head(self._last_slot_skip())
            if r is None or not self._fits(r):
                break
            self.waiting.take(r.rid)
            r.state = "prefill"
            self.running[r.rid] = r
            self.group_running[r.group] += 1
            self._admit(r, hits, evicted)
            admitted.append(r.rid)
            take(r)
        return StepPlan(tuple(chunks), () if hold else decode, tuple(admitted), tuple(hits),
                        tuple(evicted))

    def _last_slot_skip(self):
        """While requests run and one running slot is left, it is kept for a group with nothing
        running: ``skip(group)`` for the admission pick, else None."""
        if not self.running or len(self.running) != self.config.max_running_requests - 1:
            return None
        return lambda g: self.group_running[g] > 0

    def _admit(self, r: SchedRequest, hits: list, evicted: list) -> None:
        """Lock ``r``'s cached prefix, reserve the rest, evict what the reservation needs."""
        self.query_tokens += r.prompt_len
        if r.prompt_ids is not None:
            vals, node, m = self.cache.match_prefix(r.prompt_ids[:r.prompt_len - 1])
            self.cache.lock(node)
            r.node, r.cached, r.num_prefilled = node, m, m
            self.hit_tokens += m
            if m:
                hits.append(PrefixHit(r.rid, m, tuple(vals)))
        self.reserved_tokens += r.reserve - r.cached
        excess = self.cached_tokens + self.reserved_tokens - self.token_capacity
        if excess > 0:  # _fits checked that the evictable nodes cover it
            out = self.cache.evict(excess)
            self.evicted_tokens += sum(len(v) for v in out)
            evicted += out

    def cohort_release_next(self) -> bool:
        """Whether the next plan (cohort schedule) is a release: prompts are held back at their
        last token and no other prompt work is left."""
        return (self.config.prefill_schedule == "cohort"
                and any(r.state == "prefill" for r in self.running.values())
                and not self._cohort_work_left())

    def _fits(self, r: SchedRequest, extra_running: int = 0, extra_tokens: int = 0) -> bool:
        """Whether waiting request ``r`` can be admitted now (after ``extra_*`` more admissions;
        an estimate then, as their own prefixes are not counted). Its matched tokens need no
        new slots, but those in evictable nodes stop being free once it locks them."""
        if len(self.running) + extra_running >= self.config.max_running_requests:
            return False
        m, unlocked = self._peek(r)
        return r.reserve - m + extra_tokens <= self.free_tokens - unlocked

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
            m = self._peek(w)[0]
            if w.prompt_len - m > 1:
                return True
            n, tokens = n + 1, tokens + w.reserve - m
        return False

    # ------------------------------------------------------------------------------- finish
    def finish(self, rid: str) -> str | None:
        """Drop a finished or aborted request (after ``cache_finished``, to keep its tokens):
        its reservation and its hold on the cache end. Returns the state it was in (None if
        unknown)."""
        r = self.running.pop(rid, None)
        if r is not None:
            self.group_running[r.group] -= 1
            if self.group_running[r.group] <= 0:
                del self.group_running[r.group]
            self.reserved_tokens -= r.reserve - r.cached
            if r.node is not None:
                self.cache.unlock(r.node)
                r.node = None
            return r.state
        if rid in self.waiting:
            self.waiting.remove(rid)
            return "waiting"
        return None

    # ------------------------------------------------------------------------- prefix cache
    def cache_prefill(self, rid: str, end: int, values) -> PrefixRemap | None:
        """Cache the prompt tokens ``[0, end)`` of running request ``rid`` once launched
        (``values``: their slots, ``end`` long) and hold them for it instead of reserving them.
        Returns where its own slots duplicate cached ones (computed meanwhile by another
        request): the engine frees them and points the row at the cache's slots; else None."""
        r = self.running.get(rid)
        if r is None or r.prompt_ids is None or end <= r.cached:
            return None
        present, node = self.cache.insert(r.prompt_ids[:end], values)
        start = r.cached
        remap = None
        if present > start:
            pieces, node, _ = self.cache.match_prefix(r.prompt_ids[:end])
            remap = PrefixRemap(start, present, tuple(pieces))
        self.cache.lock(node)
        self.cache.unlock(r.node)
        self.reserved_tokens -= end - start
        r.node, r.cached = node, end
        return remap

    def cache_finished(self, rid: str, token_ids: list[int], values) -> tuple[int, int, int]:
        """Leave a finishing request's tokens with K/V (prompt and output, ``values``: their
        slots) in the cache; call before ``finish``. Returns ``(shared, dup_start, dup_stop)``:
        the row's first ``shared`` slots now belong to the cache, except ``[dup_start,
        dup_stop)``, duplicates of cached slots that the caller frees with the rest."""
        r = self.running.get(rid)
        if r is None or r.node is None or len(token_ids) <= r.cached:
            c = r.cached if r is not None else 0
            return c, c, c
        present, _ = self.cache.insert(list(token_ids), values)
        return len(token_ids), r.cached, max(present, r.cached)

    def flush_cache(self) -> list:
        """Evict every cache node no running request holds; returns their values (to free)."""
        return self.cache.flush() if self.cache is not None else []

    # -------------------------------------------------------------------------------- stats
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
