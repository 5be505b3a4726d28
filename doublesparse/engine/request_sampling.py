"""What sampling needs beyond the logits: per-request token history (for the penalties), logit
biases, the stop ids held back until min_tokens, grammar matchers (for constrained decoding)
and log-probabilities, applied to one batch of rows.

Everything runs on the logits' device except the grammar bitmask, which xgrammar fills on the
host. Requests that ask for none of these cost nothing here: no history is allocated, no
log-softmax is computed, and :func:`sample_requests` is then exactly :func:`sampler.sample`.
"""

from __future__ import annotations

import torch

from .sampler import apply_penalties, sample, token_logprobs
from .sampling_params import LOGPROBS_MAX, SamplingParams
from ..kernels.transfer import to_device

# Width of one row of the packed logprobs (see sampler.token_logprobs): a fixed width lets the
# rows of a step's prefill and decode samples be concatenated into one host copy.
LOGPROB_COLS = 1 + 2 * LOGPROBS_MAX


class RequestSampling:
    """Per-request state: output token counts and the prompt's tokens on the device when a
    penalty is on ([V] float32 and [V] bool), the logit bias ([k] int64 ids, [k] float32
    biases, on the device), the stop ids held back until min_tokens (a host list and [s] int64
    on the device), the grammar matcher when constrained, and how many tokens were sampled."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int,
                 device: torch.device, grammar=None, stop_ids=()) -> None:
        self.counts = self.prompt_mask = self.matcher = None
        self.bias_ids = self.bias_vals = self.held_ids = None
        self.min_tokens = params.min_tokens
        self.sampled = 0
        if params.penalized:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[torch.tensor(prompt_ids, dtype=torch.long)] = True
            self.prompt_mask = to_device(mask, device)
        if params.logit_bias:
            ids, vals = zip(*params.logit_bias)
            self.bias_ids = to_device(torch.tensor(ids, dtype=torch.long), device)
            self.bias_vals = to_device(torch.tensor(vals, dtype=torch.float32), device)
        self.held: list[int] = sorted(i for i in stop_ids if 0 <= i < vocab_size) \
            if params.min_tokens else []
        if self.held:
            self.held_ids = to_device(torch.tensor(self.held, dtype=torch.long), device)
        if params.constrained:
            self.matcher = grammar.matcher(params)

    @property
    def holding(self) -> bool:
        """Whether the stop ids are still held back (fewer than min_tokens sampled)."""
        return bool(self.held) and self.sampled < self.min_tokens

    def accept(self, tok: int) -> bool:
        """The token reached the host: advance the matcher. True when the request must stop: the
        grammar took its stop token (a complete grammar allows nothing else), or refused a token
        (only possible for a token sampled before the mask, e.g. a dropped overlap token)."""
        if self.matcher is None:
            return False
        return not self.matcher.accept_token(tok) or self.matcher.is_terminated()


def needs_state(p: SamplingParams) -> bool:
    return p.penalized or p.constrained or bool(p.logit_bias) or p.min_tokens > 0


def sample_requests(logits: torch.Tensor, reqs: list, grammar=None):
    """Sample one token per row and compute logprobs for the rows that asked.

    logits [N, V] float32; reqs[i] has ``params`` (SamplingParams), ``generator`` and
    ``sampling`` (RequestSampling or None). Returns (tokens [N] int64, logprobs
    [N, LOGPROB_COLS] float64 or None when no row asked; rows that did not ask are NaN).
    """
    params = [r.params for r in reqs]
    lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    lp_idx = to_device(torch.tensor(lp_rows), logits.device) if lp_rows else None
    raw_lp = logits[lp_idx] if lp_rows else None
    pen = [i for i, r in enumerate(reqs) if r.sampling is not None and r.sampling.counts is not None]
    if pen:
        s = [reqs[i].sampling for i in pen]
        f = lambda name: to_device(torch.tensor([float(getattr(params[i], name)) for i in pen]),
                                   logits.device)
        idx = to_device(torch.tensor(pen), logits.device)
        logits = logits.clone()
        logits[idx] = apply_penalties(logits[idx], torch.stack([x.counts for x in s]),
                                      torch.stack([x.prompt_mask for x in s]),
                                      f("repetition_penalty"), f("frequency_penalty"),
                                      f("presence_penalty"))
    states = [r.sampling for r in reqs]
    biased = [i for i, s in enumerate(states) if s is not None and s.bias_ids is not None]
    held = [i for i, s in enumerate(states) if s is not None and s.holding and s.matcher is None]
    if biased or held:
        logits = logits if pen else logits.clone()
        _scatter_rows(logits, biased, [states[i].bias_ids for i in biased],
                      [states[i].bias_vals for i in biased], accumulate=True)
        _scatter_rows(logits, held, [states[i].held_ids for i in held], None, accumulate=False)
    con = [i for i, s in enumerate(states) if s is not None and s.matcher is not None]
    if con:
        avoid = [states[i].held if states[i].holding else None for i in con]
        logits = grammar.mask_logits(logits if (pen or biased or held) else logits.clone(), con,
                                     [states[i].matcher for i in con],
                                     avoid if any(avoid) else None)
    tokens = sample(logits, params, [r.generator for r in reqs])
    for i in pen:
        c = reqs[i].sampling.counts
        c.index_add_(0, tokens[i:i + 1], torch.ones(1, dtype=c.dtype, device=c.device))
    out = None
    if lp_rows:
        out = torch.full((len(reqs), LOGPROB_COLS), float("nan"), dtype=torch.float64,
                         device=logits.device)
        out[lp_idx] = token_logprobs(raw_lp, tokens[lp_idx], LOGPROBS_MAX)
    for s in states:  # last: a failed batch is sampled again row by row
        if s is not None:
            s.sampled += 1
    return tokens, out


def _scatter_rows(logits: torch.Tensor, rows: list[int], ids: list, vals: list | None,
                  accumulate: bool) -> None:
    """logits[rows[j], ids[j]] += vals[j] (accumulate) or = -inf (vals None), in place, in one
    indexed write for all rows. logits [N, V]; ids[j] [k_j] int64 and vals[j] [k_j] float32 on
    logits' device; the row index is built on the host from the counts, so nothing syncs."""
    if not rows:
        return
    dev = logits.device
    counts = [int(t.shape[0]) for t in ids]
    row_idx = to_device(torch.repeat_interleave(torch.tensor(rows), torch.tensor(counts)), dev)
    col_idx = torch.cat(ids) if len(ids) > 1 else ids[0]
    if vals is None:
        v = torch.full((sum(counts),), float("-inf"), dtype=logits.dtype, device=dev)
    else:
        v = (torch.cat(vals) if len(vals) > 1 else vals[0]).to(logits.dtype)
    logits.index_put_((row_idx, col_idx), v, accumulate=accumulate)


def unpack_logprobs(row: list[float], k: int) -> tuple[float, list[tuple[int, float]]]:
    """One host row of the packed logprobs -> (sampled token's logprob, [(id, logprob)] x k)."""
    top = [(int(row[1 + LOGPROBS_MAX + j]), row[1 + j]) for j in range(k)]
    return row[0], top
