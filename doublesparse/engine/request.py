"""A request's state inside the engine, what a step hands back, and the per-request parts of a
step (sampling a batch with per-row failure isolation, the finished request's metadata)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .sampler import LOGPROB_COLS, RequestSampling, sample_requests
from .sampling_params import SamplingParams
from .text import Detokenizer


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    meta: dict | None = None       # set when finished: see Engine.generate
    # per new token, when the request asked for logprobs: (logprob, [(token id, logprob)] x k)
    logprobs: list | None = None
    # per prompt token, on the request's first output when it asked for prompt_logprobs: None for
    # the first token, then (logprob, [(token id, logprob)] x k) as above
    prompt_logprobs: list | None = None


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    stop_ids: frozenset
    detok: Detokenizer
    t_arrival: float
    output_ids: list[int] = field(default_factory=list)
    row: int | None = None
    num_cached: int = 0            # tokens whose K/V are in the pool
    cached_tokens: int = 0         # prompt tokens found in the prefix cache at admission
    decode_steps: int = 0
    sparse_decode_steps: int = 0
    t_first_token: float | None = None
    finish_reason: str | None = None
    launched: int = 0              # output tokens sampled or being sampled on the device
    error: str | None = None       # set when this request's own sampling failed: it ends "error"
    sampling: RequestSampling | None = None  # penalties' history, grammar matcher
    group: str | None = None       # fair-admission group (its client request); None: its own
    prompt_logprobs: list | None = None  # being filled chunk by chunk, until sent (take_prompt_logprobs)
    ds_stats: dict | None = None   # set when finished, for a request that asked (return_ds_stats)

    def take_prompt_logprobs(self) -> list | None:
        """The prompt logprobs (engine/prompt_logprobs.py), once: they travel with the request's
        first output (its first token, or its end when it samples nothing)."""
        out, self.prompt_logprobs = self.prompt_logprobs, None
        return out


@dataclass
class Launched:
    """One step's sampled tokens on their way to the host: ``tokens[i]`` belongs to ``reqs[i]``."""

    reqs: list
    tokens: torch.Tensor           # [N] int64, host (pinned on CUDA) once ``ready`` has fired
    ready: "torch.cuda.Event | None"
    sparse: list                   # per entry: None (a prefill's first token) or whether its decode was sparse
    t_launch: float
    has_prefill: bool
    logprobs: torch.Tensor | None = None   # [N, LOGPROB_COLS] float64, host, when any entry asked
    lp_ready: "torch.cuda.Event | None" = None
    # prompt logprobs of this step's prefill: ([M, LOGPROB_COLS] float64 host, event, spans), see
    # engine/prompt_logprobs.py
    prompt_lps: tuple | None = None
    prefill_only: list = field(default_factory=list)  # prompts that ended here with max_new_tokens 0


def sample_isolated(logits: torch.Tensor, reqs: list, grammar) -> tuple:
    """Sample the batch; if that fails, sample row by row so that only the requests whose own
    sampling fails end (``error`` set; they end with reason "error" at collection) and the rest of
    the batch goes on. logits [N, V] -> ([N] int64, [N, LOGPROB_COLS] float64 logprobs or None)."""
    try:
        return sample_requests(logits, reqs, grammar)
    except Exception:  # noqa: BLE001 - any failure: find the rows that cause it
        pass
    toks, lps = [], []
    want_lp = any(r.params.logprobs is not None for r in reqs)
    for i, r in enumerate(reqs):
        lp = None
        try:
            t, lp = sample_requests(logits[i:i + 1], [r], grammar)
        except Exception as e:  # noqa: BLE001 - this request's own failure ends only it
            r.error = f"sampling failed: {type(e).__name__}: {e}"
            t = torch.zeros(1, dtype=torch.int64, device=logits.device)
        toks.append(t)
        lps.append(lp if lp is not None else torch.full(
            (1, LOGPROB_COLS), float("nan"), dtype=torch.float64, device=logits.device))
    return torch.cat(toks), (torch.cat(lps) if want_lp else None)


def request_meta(r: Request) -> dict:
    """What ``Engine.generate`` returns as ``meta`` (plus the text, popped by it)."""
    now = time.perf_counter()
    ttft = (r.t_first_token - r.t_arrival) if r.t_first_token else None
    return dict(prompt_tokens=len(r.prompt_ids), completion_tokens=len(r.output_ids),
                finish_reason=r.finish_reason, decode_steps=r.decode_steps,
                sparse_decode_steps=r.sparse_decode_steps, cached_tokens=r.cached_tokens,
                e2e_latency=now - r.t_arrival,
                ttft=ttft, decode_latency=(now - r.t_first_token) if r.t_first_token else 0.0,
                text=r.detok.text, **({"error": r.error} if r.error else {}),
                **({"ds_stats": r.ds_stats} if r.ds_stats is not None else {}))
