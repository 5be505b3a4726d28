"""What sampling needs beyond the logits: per-request token history (for the penalties), grammar
matchers (for constrained decoding) and log-probabilities, applied to one batch of rows.

Everything runs on the logits' device except the grammar bitmask, which xgrammar fills on the
host. Requests that ask for none of these cost nothing here: no history is allocated, no
log-softmax is computed, and :func:`sample_requests` is then exactly :func:`sampler.sample`.
"""

from __future__ import annotations

import torch

from .sampler import apply_penalties, sample, token_logprobs
from .sampling_params import LOGPROBS_MAX, SamplingParams
from .transfer import to_device

# Width of one row of the packed logprobs (see sampler.token_logprobs): a fixed width lets the
# rows of a step's prefill and decode samples be concatenated into one host copy.
LOGPROB_COLS = 1 + 2 * LOGPROBS_MAX


class RequestSampling:
    """Per-request state: output token counts and the prompt's tokens on the device when a
    penalty is on ([V] float32 and [V] bool), and the grammar matcher when constrained."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int,
                 device: torch.device, grammar=None) -> None:
        self.counts = self.prompt_mask = self.matcher = None
        if params.penalized:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[torch.tensor(prompt_ids, dtype=torch.long)] = True
            self.prompt_mask = to_device(mask, device)
        if params.constrained:
            self.matcher = grammar.matcher(params.json_schema, params.ebnf)

    def accept(self, tok: int) -> bool:
        """The token reached the host: advance the matcher. True when the request must stop: the
        grammar took its stop token (a complete grammar allows nothing else), or refused a token
        (only possible for a token sampled before the mask, e.g. a dropped overlap token)."""
        if self.matcher is None:
            return False
        return not self.matcher.accept_token(tok) or self.matcher.is_terminated()


def needs_state(p: SamplingParams) -> bool:
    return p.penalized or p.constrained


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
    con = [i for i, r in enumerate(reqs) if r.sampling is not None and r.sampling.matcher is not None]
    if con:
        logits = grammar.mask_logits(logits if pen else logits.clone(), con,
                                     [reqs[i].sampling.matcher for i in con])
    tokens = sample(logits, params, [r.generator for r in reqs])
    for i in pen:
        c = reqs[i].sampling.counts
        c.index_add_(0, tokens[i:i + 1], torch.ones(1, dtype=c.dtype, device=c.device))
    if not lp_rows:
        return tokens, None
    out = torch.full((len(reqs), LOGPROB_COLS), float("nan"), dtype=torch.float64,
                     device=logits.device)
    packed = token_logprobs(raw_lp, tokens[lp_idx], LOGPROBS_MAX)
    out[lp_idx] = packed
    return tokens, out


def unpack_logprobs(row: list[float], k: int) -> tuple[float, list[tuple[int, float]]]:
    """One host row of the packed logprobs -> (sampled token's logprob, [(id, logprob)] x k)."""
    top = [(int(row[1 + LOGPROBS_MAX + j]), row[1 + j]) for j in range(k)]
    return row[0], top
