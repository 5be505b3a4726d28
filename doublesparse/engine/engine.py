"""The engine: requests in, tokens out. Owns the model, pools, backend, scheduler and sampler.

Overlap schedule (default on CUDA; ``disable_overlap_schedule`` turns it off; on CPU, where it
gains nothing because every launch runs at once, it is off unless ``Engine.overlap`` is set
before the first step, as the tests do): ``step`` launches step n+1 first and only then reads
step n's tokens and does its host work (stop checks, detokenizing, finishing), so the GPU is not
idle while Python runs. What makes this possible: every sampled
token is also scattered on the device into ``_last_tok[row]``, and the next decode takes its input
ids from there; positions are known on the host ahead of the tokens. The price: a request that
stops at step n (stop token or string) was already in step n+1, whose extra token is computed and
dropped; its K/V slot is freed with the rest. A request that reaches max_new_tokens is not
launched again. Outputs reach the caller one ``step`` later.

Thread model: ``add_request`` / ``abort`` may be called from any thread; they validate at once
(so refusals raise in the caller) and hand the request to an inbox that ``step`` drains. ``step``
itself must be called from one thread at a time (the server's background loop).
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from typing import Protocol

import torch

from ..attention.budget import DENSE
from ..config import EngineConfig
from . import prefix_cache
from . import prompt_logprobs as prompt_lp
from .grammar import GrammarBackend
from .memory import dtype_name
from .request import Launched, Request, StepOutput, request_meta, sample_isolated
from .sampler import LOGPROB_COLS, RequestSampling, make_generator, needs_state, unpack_logprobs
from .sampling_params import SamplingParams
from .setup import EngineParts, OnDemandCalibration, build_parts
from .text import Detokenizer
from ..kernels.transfer import to_device, to_host_async


class StartRanks(Protocol):
    """``tp_size`` > 1: start the engine's tensor-parallel ranks (on the first ranks of ``group``
    when given, else on processes started for it) and return rank 0's context, which
    :func:`~doublesparse.engine.setup.build_parts` asks for its shard, memory and runner."""

    def __call__(self, cfg: EngineConfig, model=None, group=None): ...


NO_RANKS = ("tp_size {} runs ranks in other processes, which this engine was built without a "
            "starter for: build it as doublesparse.Engine (or pass start_ranks=)")


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, model=None, tokenizer=None,
                 progress: bool = True, tp_group=None, start_ranks: StartRanks | None = None,
                 calibrate: OnDemandCalibration | None = None, **kwargs):
        """``Engine(**EngineConfig fields)``, or ``Engine(config)``. ``model``/``tokenizer``
        inject prebuilt objects (tests, stand-ins) instead of loading ``model_path`` (with
        ``tp_size`` > 1 each rank takes its shard of ``model``). ``tp_group``: a started
        :class:`~doublesparse.distributed.group.TPGroup` of ``tp_size`` ranks to run on (several
        engines in turn may share one); default: ``start_ranks`` starts its own.

        The engine stands below tensor parallelism and calibration, so whoever builds it hands
        them in (``doublesparse.Engine`` does, for the commands and the Python API):
        ``start_ranks`` (:class:`StartRanks`), needed with ``tp_size`` > 1; ``calibrate``
        (:class:`~doublesparse.engine.setup.OnDemandCalibration`), needed with
        ``ds_channel_config_path="auto"``."""
        cfg = config.replace(**kwargs) if config is not None else EngineConfig(**kwargs)
        self.config = cfg
        self._tp = None
        if cfg.tp_size > 1:
            if start_ranks is None:
                raise ValueError(NO_RANKS.format(cfg.tp_size))
            self._tp = start_ranks(cfg, model, tp_group)
        try:
            self.parts: EngineParts = build_parts(cfg, model=model, tokenizer=tokenizer, progress=progress,
                                                  tp=self._tp, calibrate=calibrate)
        except BaseException as e:
            if self._tp is not None:
                self._tp.abort(e)
            raise
        p = self.parts
        self.model_config = p.model.config
        self.tokenizer = p.tokenizer
        self.max_context_len = p.max_context_len
        # Double Sparsity's operating point in use (None: DS off): source "calibrated" or
        # "shape default", r, budget, selection, sink/recent, KL target and what calibration
        # measured, the flags that override it, and "summary" (one line); see operating_point.py
        self.operating_point: dict | None = p.operating_point
        self._inbox: collections.deque = collections.deque()
        self._inbox_by_rid: dict[str, Request] = {}  # the inbox by id: aborting there is O(1)
        self._abort_inbox: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._reqs: dict[str, Request] = {}
        self._pending: list[StepOutput] = []   # outputs of aborts done outside step()
        self._known: set[str] = set()
        self._counter = 0
        self.counters = collections.Counter()
        self.overlap = not cfg.disable_overlap_schedule and p.device.type == "cuda"
        self._inflight: Launched | None = None
        # each request row's latest sampled token, on the device: the next decode's input ids
        # (rows 1..max_reqs; row 0 is req_to_token's padding row)
        self._last_tok = torch.zeros(p.memory.plan.max_reqs + 1, dtype=torch.int64, device=p.device)
        self._grammar: GrammarBackend | None = None   # built by the first constrained request

    # ------------------------------------------------------------------------- requests
    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (dummy weights): pass token ids")
            return list(self.tokenizer.encode(prompt))
        ids = [int(t) for t in prompt]
        V = self.model_config.vocab_size
        if any(t < 0 or t >= V for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {V})")
        return ids

    def _check_ds_overrides(self, sp: SamplingParams) -> None:
        ds_on = self.parts.ds is not None
        if sp.enable_double_sparsity is not None and sp.enable_double_sparsity != ds_on:
            raise ValueError(f"per-request enable_double_sparsity={sp.enable_double_sparsity} is not "
                             f"supported: this engine runs with Double Sparsity {'on' if ds_on else 'off'}")
        if sp.ds_heavy_token_num is not None:
            budget = self.parts.ds.policy.budget if ds_on else None
            if budget is None or budget.ratio or sp.ds_heavy_token_num != budget.k_max:
                have = budget.describe() if budget else "dense decode"
                raise ValueError(f"per-request ds_heavy_token_num={sp.ds_heavy_token_num} is not "
                                 f"supported: the engine decodes every request with {have}")

    def add_request(self, prompt, sampling_params=None, request_id: str | None = None,
                    group: str | None = None) -> str:
        """Queue a request; returns its id. Raises ValueError (RequestRefused) if it can never run.
        ``group``: requests sharing one (a client request's fanned-out samples) are admitted in
        turn with other groups' (see :mod:`doublesparse.engine.scheduler`); None: its own."""
        sp = SamplingParams.from_any(sampling_params)
        self._check_ds_overrides(sp)
        V = self.model_config.vocab_size
        if sp.logit_bias and sp.logit_bias[-1][0] >= V:
            raise ValueError(f"logit_bias names token {sp.logit_bias[-1][0]}, past the "
                             f"vocabulary ({V} tokens)")
        ids = self._encode(prompt)
        self.parts.scheduler.check(len(ids), sp.max_new_tokens)
        with self._lock:
            rid = request_id or uuid.uuid4().hex
            if rid in self._known:
                raise ValueError(f"request id {rid!r} is already in use")
            self._known.add(rid)
            seed = sp.seed if sp.seed is not None else self.config.seed * 1_000_003 + self._counter
            self._counter += 1
        stop_ids = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stop_ids |= set(self.model_config.eos_token_ids or ())
        gen = None if sp.greedy else make_generator(seed, self.parts.device)
        try:
            state = self._sampling_state(sp, ids, stop_ids)
        except ValueError:
            with self._lock:
                self._known.discard(rid)
            raise
        req = Request(rid, ids, sp, gen, frozenset(stop_ids),
                   Detokenizer(self.tokenizer, sp.stop, sp.skip_special_tokens), time.perf_counter(),
                   sampling=state, group=group,
                   prompt_logprobs=[None] if sp.prompt_logprobs is not None else None)
        self._inbox_by_rid[rid] = req
        self._inbox.append(req)
        return rid

    def _sampling_state(self, sp: SamplingParams, ids: list[int], stop_ids: set) -> RequestSampling | None:
        """Penalty history and grammar matcher, when the request needs them (ValueError for a
        grammar that does not compile or an engine without xgrammar)."""
        if not needs_state(sp):
            return None
        V = self.model_config.vocab_size
        if sp.constrained and self._grammar is None:
            eos = sorted(set(self.model_config.eos_token_ids or ()))
            self._grammar = GrammarBackend(self.tokenizer, V, eos)
        return RequestSampling(sp, ids, V, self.parts.device, self._grammar, stop_ids)

    def abort(self, request_id: str) -> None:
        """Abort a request. Its KV is freed at once when no step is running (the server calls this
        from its engine thread), else at the start of the next step. The "abort" StepOutput comes
        from the next ``step()``. Unknown / finished ids are ignored."""
        if self._step_lock.acquire(blocking=False):
            try:
                self._abort_now(request_id)
            finally:
                self._step_lock.release()
        else:
            self._abort_inbox.append(request_id)

    def _abort_now(self, rid: str) -> None:
        if rid in self._reqs:
            self._pending.append(self._finish(self._reqs[rid], "abort", []))
            return
        req = self._inbox_by_rid.pop(rid, None)
        if req is not None:  # still in the inbox: the drain skips it
            req.finish_reason = "abort"
            with self._lock:
                self._known.discard(rid)
            self._pending.append(StepOutput(rid, [], "", True, "abort", len(req.prompt_ids), 0,
                                            meta=request_meta(req)))

    def has_unfinished(self) -> bool:
        return bool(self._inbox) or bool(self._reqs) or bool(self._pending) or self._inflight is not None

    # ----------------------------------------------------------------------------- step
    def step(self) -> list[StepOutput]:
        with self._step_lock:
            return self._step()

    def _step(self) -> list[StepOutput]:
        p = self.parts
        while self._abort_inbox:
            self._abort_now(self._abort_inbox.popleft())
        while self._inbox:
            req = self._inbox.popleft()
            if req.finish_reason is not None:  # aborted in the inbox
                continue
            self._inbox_by_rid.pop(req.rid, None)
            # prompt logprobs need every prompt token's logits, which a cached prefix lacks: such
            # requests neither match nor fill the prefix cache (simple, and always correct)
            cacheable = None if prompt_lp.wants(req) else req.prompt_ids
            p.scheduler.add(req.rid, len(req.prompt_ids), req.params.max_new_tokens, cacheable,
                            req.group)
            self._reqs[req.rid] = req
        outs, self._pending = self._pending, []
        if self._inflight is not None and any(
                r.sampling is not None and r.sampling.matcher is not None and r.finish_reason is None
                for r in self._inflight.reqs):
            # a grammar's mask for the next token needs this token on the host first
            launched, self._inflight = self._inflight, None
            outs.extend(self._collect(launched))
        if (self._inflight is not None and self._inflight.has_prefill
                and p.scheduler.cohort_release_next()):
            # With the overlap schedule this plan would be made while the cohort's last prefill
            # still runs (~1 s for a 32K prompt), so requests arriving meanwhile would miss the
            # release, and a request released alone would then wait through their whole prefill
            # with its first token out. Collect first; the caller hands over new arrivals, and
            # the next step plans with them.
            launched, self._inflight = self._inflight, None
            outs.extend(self._collect(launched))
            return outs
        plan = p.scheduler.schedule()
        hits = {h.rid: h.num_tokens for h in plan.prefix_hits}
        for rid in plan.admitted:
            r = self._reqs[rid]
            r.row = p.memory.rows.alloc()
            # a tiered memory (DS-Offload's device tier) places the row by its new tokens
            p.memory.admit_row(r.row, len(r.prompt_ids) + r.params.max_new_tokens - hits.get(rid, 0))
        rows = {rid: r.row for rid, r in self._reqs.items() if r.row is not None}
        prefix_cache.apply_admission(p.memory, plan, rows)
        for hit in plan.prefix_hits:
            self._reqs[hit.rid].num_cached = self._reqs[hit.rid].cached_tokens = hit.num_tokens
        launched = self._launch(plan)
        prefix_cache.cache_prefill(p.memory, p.scheduler, plan.prefill, rows)
        if self.overlap:
            launched, self._inflight = self._inflight, launched
        if launched is not None:
            outs.extend(self._collect(launched))
        if (self._inflight is not None and self._inflight.reqs
                and all(r.finish_reason for r in self._inflight.reqs)):
            self._inflight = None  # only dropped tokens left in it: nothing to wait for
        return outs

    def _launch(self, plan) -> Launched | None:
        """Run the plan's forwards and sampling; nothing here waits for the GPU."""
        p = self.parts
        t0 = time.perf_counter()
        reqs_out, toks, lps = [], [], []
        prompt_lps, prefill_only = None, []
        if plan.prefill:
            reqs = [self._reqs[c.rid] for c in plan.prefill]
            # a prompt that ends here samples its first token, unless it asked for none
            sampled = [c.last and r.params.max_new_tokens > 0 for r, c in zip(reqs, plan.prefill)]
            every = [prompt_lp.wants(r) for r in reqs]
            logits = p.runner.prefill([r.row for r in reqs], [c.start for c in plan.prefill],
                                      [r.prompt_ids[c.start:c.end] for r, c in zip(reqs, plan.prefill)],
                                      sampled, every if any(every) else None)
            if any(every):
                logits, packed, spans = prompt_lp.split(logits, reqs, plan.prefill, sampled)
                prompt_lps = (*to_host_async(packed), spans) if packed is not None else (None, None, spans)
            for r, c in zip(reqs, plan.prefill):
                r.num_cached = c.end
            prefill_only = [r for r, c, s in zip(reqs, plan.prefill, sampled) if c.last and not s]
            done = [r for r, s in zip(reqs, sampled) if s]
            if done:
                t, lp = self._sample(logits, done)
                lps.append((lp, len(done)))
                self._last_tok[to_device(torch.tensor([r.row for r in done]), p.device)] = t
                reqs_out += done
                toks.append(t)
            self.counters["prefill_tokens"] += plan.num_prefill_tokens
        # a request whose last token is still on its way has nothing left to decode
        dec = [r for r in (self._reqs[rid] for rid in plan.decode) if r.launched < r.params.max_new_tokens]
        if dec:
            positions = [r.num_cached for r in dec]
            rows_dev = to_device(torch.tensor([r.row for r in dec]), p.device)
            # one plan per step: the runner launches it, and it says which requests ran sparse
            step_plan = p.backend.decode_plan([n + 1 for n in positions])
            logits = p.runner.decode([r.row for r in dec], self._last_tok[rows_dev], positions, step_plan)
            ks = step_plan[0]
            t, lp = self._sample(logits, dec)
            lps.append((lp, len(dec)))
            self._last_tok[rows_dev] = t
            sparse_rows = [False] * len(dec) if ks is None else [k != DENSE for k in ks]
            for r in dec:
                r.num_cached += 1
            reqs_out += dec
            toks.append(t)
        if not reqs_out:
            if not plan.prefill:
                return None
            # A prefill-only step (a chunk that is not a prompt's last) samples nothing; it is
            # still collected, through one event, so that its time counts as prefill time.
            tokens, ready = to_host_async(torch.empty(0, dtype=torch.long, device=p.device))
            return Launched([], tokens, ready, [], t0, True, prompt_lps=prompt_lps,
                            prefill_only=prefill_only)
        for r in reqs_out:
            r.launched += 1
        tokens, ready = to_host_async(torch.cat(toks) if len(toks) > 1 else toks[0])
        sparse = [None] * (len(reqs_out) - len(dec)) + (sparse_rows if dec else [])
        out = Launched(reqs_out, tokens, ready, sparse, t0, bool(plan.prefill), prompt_lps=prompt_lps,
                       prefill_only=prefill_only)
        if any(lp is not None for lp, _ in lps):  # a second copy, waited on with the tokens'
            out.logprobs, out.lp_ready = to_host_async(torch.cat([
                lp if lp is not None else torch.full((n, LOGPROB_COLS), float("nan"),
                                                     dtype=torch.float64, device=p.device)
                for lp, n in lps]))
        return out

    def _sample(self, logits: torch.Tensor, reqs: list):
        return sample_isolated(logits, reqs, self._grammar)

    def fail_running(self, err: BaseException) -> list[StepOutput]:
        """After ``step`` raised: end every request the step loop holds with reason "error", free
        their slots and drop the launch in flight, so that the engine can step again. Requests
        still in the inbox (added since the failed step began) stay queued. Raises the rank's
        error instead when a tensor-parallel rank has died (nothing can step again)."""
        if self._tp is not None:
            self._tp.check()
        with self._step_lock:
            self._inflight = None
            outs, self._pending = self._pending, []
            for r in list(self._reqs.values()):
                r.error = r.error or f"engine step failed: {type(err).__name__}: {err}"
                outs.append(self._finish(r, "error", [], release_all=True))
            self.counters["failed_steps"] += 1
            # the failed step's K/V may be partial; cached prefixes are cheap to recompute
            prefix_cache.flush(self.parts.memory, self.parts.scheduler)
            return outs

    def _collect(self, launched: Launched) -> list[StepOutput]:
        """Wait for a launched step's tokens and hand them to their requests."""
        if launched.ready is not None:
            launched.ready.synchronize()
        if launched.lp_ready is not None:
            launched.lp_ready.synchronize()
        if launched.prompt_lps is not None:
            host, ready, spans = launched.prompt_lps
            if ready is not None:
                ready.synchronize()
            prompt_lp.attach(host.tolist() if host is not None else [], spans)
        now = time.perf_counter()
        outs = []
        decoded = sparse_any = 0
        lp_rows = launched.logprobs.tolist() if launched.logprobs is not None else None
        for i, (r, tok, sp) in enumerate(zip(launched.reqs, launched.tokens.tolist(), launched.sparse)):
            if r.finish_reason is not None:   # it stopped (or was aborted) after this launch
                continue
            if r.error is not None:
                outs.append(self._finish(r, "error", []))
                continue
            if sp is not None:  # counted here, not at launch, so a dropped extra token never counts
                r.decode_steps += 1
                r.sparse_decode_steps += int(sp)
                decoded += 1
                sparse_any |= bool(sp)
            lp = None
            if lp_rows is not None and r.params.logprobs is not None:
                lp = unpack_logprobs(lp_rows[i], r.params.logprobs)
            outs.append(self._on_token(r, tok, now, lp))
        for r in launched.prefill_only:  # max_new_tokens 0: the prompt is done, nothing to sample
            if r.finish_reason is None:
                out = self._finish(r, "length", [])
                out.prompt_logprobs = r.take_prompt_logprobs()
                outs.append(out)
        c = self.counters
        if decoded:
            c["decode_steps"] += 1
            c["sparse_decode_steps"] += sparse_any
            c["decode_tokens"] += decoded
        # wall time from launch to tokens read, so with the overlap schedule the GPU time is in it
        if launched.has_prefill:
            c["prefill_time"] += now - launched.t_launch
        if any(sp is not None for sp in launched.sparse):
            c["decode_time"] += now - launched.t_launch
        return outs

    def _on_token(self, r: Request, tok: int, now: float, lp=None) -> StepOutput:
        if r.t_first_token is None:
            r.t_first_token = now
        r.output_ids.append(tok)
        self.counters["generation_tokens"] += 1
        reason = None
        lps = None if lp is None else [lp]
        if tok in r.stop_ids or (r.sampling is not None and r.sampling.accept(tok)):
            reason = "stop"
            delta = r.detok.flush()
        else:
            # stop strings match from the token after min_tokens on (vLLM's rule)
            delta, hit = r.detok.push(r.output_ids,
                                      match_stop=len(r.output_ids) > r.params.min_tokens)
            if hit:
                reason = "stop"
            elif len(r.output_ids) >= r.params.max_new_tokens:
                reason = "length"
            if reason:
                delta += r.detok.flush()
        if reason:
            out = self._finish(r, reason, [tok], delta)
            out.logprobs = lps
            out.prompt_logprobs = r.take_prompt_logprobs()
            return out
        return StepOutput(r.rid, [tok], delta, False, None, len(r.prompt_ids), len(r.output_ids),
                          logprobs=lps, prompt_logprobs=r.take_prompt_logprobs())

    def _finish(self, r: Request, reason: str, new_ids: list[int], delta: str = "",
                release_all: bool = False) -> StepOutput:
        r.finish_reason = reason
        self._ds_stats(r)
        # its prompt and output stay in the prefix cache
        prefix_cache.release_request(self.parts.memory, self.parts.scheduler, r.rid, r.row,
                                     r.prompt_ids + r.output_ids, r.num_cached, failed=release_all)
        r.row = None
        del self._reqs[r.rid]
        with self._lock:
            self._known.discard(r.rid)
        self.counters["prompt_tokens"] += len(r.prompt_ids)
        self.counters["finished_requests"] += 1
        if reason == "error":
            self.counters["failed_requests"] += 1
        return StepOutput(r.rid, new_ids, delta, True, reason, len(r.prompt_ids), len(r.output_ids),
                          meta=request_meta(r))

    def _ds_stats(self, r: Request) -> None:
        """A finishing request's sampled recall (its row's samples are dropped either way, before
        the row is reused), kept in its meta when it asked (``return_ds_stats``)."""
        probe = self.parts.recall
        recall = probe.take_request(r.row) if probe is not None and r.row is not None else None
        if r.params.return_ds_stats:
            r.ds_stats = {"double_sparsity": self.parts.ds is not None, "decode_steps": r.decode_steps,
                          "sparse_decode_steps": r.sparse_decode_steps,
                          "attention_recall": recall}

    # --------------------------------------------------------------------------- batch API
    def generate(self, prompts, sampling_params=None) -> list[dict]:
        """Run prompts to completion. ``prompts``: str, list[str], list[int] or list[list[int]];
        ``sampling_params``: one for all, or a list. Returns, per prompt, ``{"text", "token_ids",
        "meta": {prompt_tokens, completion_tokens, finish_reason, decode_steps,
        sparse_decode_steps, e2e_latency, ttft, decode_latency}}`` (and ``ds_stats`` where the
        request set ``return_ds_stats``: its decode steps and sampled attention recall), plus ``"logprobs"`` (per token:
        ``(logprob, [(id, logprob)] * k)``) and ``"prompt_logprobs"`` (per prompt token, None for
        the first) for requests that asked for them."""
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        sps = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(sps) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sps)} sampling_params")
        # validate every prompt before queueing any, so a refusal leaves nothing behind
        checked = [(self._encode(pr), SamplingParams.from_any(sp)) for pr, sp in zip(prompts, sps)]
        for ids, sp in checked:
            self._check_ds_overrides(sp)
            self.parts.scheduler.check(len(ids), sp.max_new_tokens)
        rids = [self.add_request(ids, sp) for ids, sp in checked]
        results: dict[str, dict] = {rid: {"token_ids": []} for rid in rids}
        while any("meta" not in results[r] for r in rids):
            for o in self.step():
                if o.request_id in results:
                    results[o.request_id]["token_ids"].extend(o.new_token_ids)
                    if o.logprobs:
                        results[o.request_id].setdefault("logprobs", []).extend(o.logprobs)
                    if o.prompt_logprobs is not None:
                        results[o.request_id]["prompt_logprobs"] = o.prompt_logprobs
                    if o.finished:
                        meta = dict(o.meta)
                        results[o.request_id]["text"] = meta.pop("text")
                        results[o.request_id]["meta"] = meta
        return [dict(text=results[r]["text"], token_ids=results[r]["token_ids"], meta=results[r]["meta"],
                     **{k: results[r][k] for k in ("logprobs", "prompt_logprobs") if k in results[r]})
                for r in rids]

    def close(self) -> None:
        """Free what the engine holds outside this process: with ``tp_size`` > 1, the other ranks'
        parts (and their processes, when the engine started them). Idempotent."""
        tp, self._tp = self._tp, None
        if tp is not None:
            tp.close()

    def flush_cache(self) -> int:
        """Drop every cached prefix that no running request holds (all of them when idle), so
        the pool is empty again; returns the slots freed. SGLang's ``/flush_cache``."""
        with self._step_lock:
            return prefix_cache.flush(self.parts.memory, self.parts.scheduler)

    def stats(self) -> dict:
        """``kv_used_tokens``: slots held by running requests (cached prefixes no request holds
        count as free: admission evicts them when it needs room); ``kv_cached_tokens``: slots
        in the prefix cache; ``prefix_cache_hit_tokens`` / ``prefix_cache_query_tokens``: prompt
        tokens found in the cache / of all admitted prompts; ``prefix_cache_evicted_tokens``: cached
        tokens evicted to make room; ``budget_scale``: the adaptive budget's per-layer scales
        (attention/adaptive.py), None in the other budget modes."""
        p, c, s = self.parts, self.counters, self.parts.scheduler
        return dict(running=s.num_running, waiting=s.num_waiting + len(self._inbox_by_rid),
                    kv_used_tokens=p.memory.slots.num_used - s.evictable_tokens,
                    kv_total_tokens=p.memory.slots.size, kv_cached_tokens=s.cached_tokens,
                    kv_cache_dtype=dtype_name(p.memory.plan.kv_dtype),
                    kv_reserved_tokens=s.reserved_tokens,
                    prefix_cache_hit_tokens=s.hit_tokens, prefix_cache_query_tokens=s.query_tokens,
                    prefix_cache_evicted_tokens=s.evicted_tokens,
                    decode_steps=c["decode_steps"], sparse_decode_steps=c["sparse_decode_steps"],
                    prompt_tokens=c["prompt_tokens"], generation_tokens=c["generation_tokens"],
                    prefill_tokens=c["prefill_tokens"], decode_tokens=c["decode_tokens"],
                    prefill_time=c["prefill_time"], decode_time=c["decode_time"],
                    finished_requests=c["finished_requests"], failed_requests=c["failed_requests"],
                    failed_steps=c["failed_steps"], attention_backend=p.backend.name,
                    double_sparsity=p.ds is not None, channel_source=p.channel_source,
                    channels_calibrated=p.channels_calibrated,
                    heavy_token_num=p.ds.k_max if p.ds else None,
                    decode_policy=p.ds.policy.describe() if p.ds else None,
                    heavy_channel_num=p.memory.plan.heavy_channel_num or None,
                    operating_point=(self.operating_point or {}).get("summary"),
                    attention_recall=p.recall.summary() if p.recall is not None else None,
                    budget_scale=p.adaptive.summary() if p.adaptive is not None else None)
