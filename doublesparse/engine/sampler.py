"""Token sampling: greedy, temperature, top-k, top-p, min-p; seeded per request with
torch.Generator. Also the logits processors that run before it (repetition, frequency and
presence penalties) and the log-probabilities returned to clients.

The filtering is batched over rows; only the final draw loops over the sampled rows, because each
request owns its generator (so a request's tokens do not depend on what it is batched with).

What a batch of requests needs beyond the logits (:func:`sample_requests`, with each request's
:class:`RequestSampling`): per-request token history (for the penalties), logit biases, the stop
ids held back until min_tokens, grammar matchers (for constrained decoding) and
log-probabilities. Everything runs on the logits' device except the grammar bitmask, which
xgrammar fills on the host. Requests that ask for none of these cost nothing there: no history
is allocated, no log-softmax is computed, and :func:`sample_requests` is then exactly
:func:`sample`.
"""

from __future__ import annotations

import torch

from .sampling_params import LOGPROBS_MAX, SamplingParams
from ..kernels.transfer import to_device

# Width of one row of the packed logprobs (see token_logprobs): a fixed width lets the rows of a
# step's prefill and decode samples be concatenated into one host copy.
LOGPROB_COLS = 1 + 2 * LOGPROBS_MAX


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF)
    return g


def filter_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 top_k: torch.Tensor, min_p: torch.Tensor | None = None):
    """Sorted, renormalised probabilities after temperature / top-k / top-p / min-p.

    logits [B, V] float32; temperature, top_p [B] float32; top_k [B] int64 (<= 0: off);
    min_p [B] float32 or None (0: off).
    Returns (probs [B, V] float32 in descending-logit order, order [B, V] int64 token ids).
    """
    x = logits.float() / temperature.clamp_min(1e-6)[:, None]
    vals, order = torch.sort(x, dim=-1, descending=True)
    probs = torch.softmax(vals, dim=-1)
    V = probs.shape[-1]
    rank = torch.arange(V, device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))
    drop = rank >= k[:, None]
    # top-p keeps the smallest prefix whose mass reaches p: drop a token when the mass before it
    # already does (the first token always survives)
    before = probs.cumsum(-1) - probs
    drop |= before >= top_p[:, None]
    if min_p is not None:
        drop |= probs < min_p[:, None] * probs[:, :1]
    # the most likely token always survives, so no row can be left with zero mass (and NaNs)
    drop[:, 0] = False
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    return probs, order


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """Next token per row: logits [B, V] float32 -> [B] int64 (on logits' device)."""
    out = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    dev = logits.device
    idx = to_device(torch.tensor(rows), dev)
    sub = params_tensors([params[i] for i in rows], dev)
    min_p = None
    if any(params[i].min_p > 0 for i in rows):
        min_p = to_device(torch.tensor([float(params[i].min_p) for i in rows]), dev)
    probs, order = filter_probs(logits[idx], *sub, min_p=min_p)
    picks = []
    for j, i in enumerate(rows):
        picks.append(torch.multinomial(probs[j], 1, generator=generators[i]))
    chosen = torch.gather(order, 1, torch.stack(picks))          # [n, 1]
    out[idx] = chosen[:, 0]
    return out


def params_tensors(params: list[SamplingParams], device) -> tuple[torch.Tensor, ...]:
    t = torch.tensor([float(p.temperature) for p in params], dtype=torch.float32)
    p = torch.tensor([float(p.top_p) for p in params], dtype=torch.float32)
    k = torch.tensor([int(p.top_k or 0) for p in params], dtype=torch.int64)
    return to_device(t, device), to_device(p, device), to_device(k, device)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> torch.Tensor:
    """Penalised logits (a new tensor).

    logits [n, V] float32; counts [n, V] float32: how often each token was generated so far;
    prompt_mask [n, V] bool: tokens of the prompt; repetition, frequency, presence [n] float32.
    The repetition penalty covers prompt and output tokens (as in HF and vLLM), the OpenAI
    frequency and presence penalties only output tokens.
    """
    x = logits.float()
    seen = prompt_mask | (counts > 0)
    r = repetition[:, None]
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    return x - counts * frequency[:, None] - (counts > 0).float() * presence[:, None]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """The model's log-probabilities of the sampled tokens and of the k most likely ones.

    logits [n, V] (raw: before penalties, temperature and masks); tokens [n] int64.
    Returns [n, 1 + 2k] float64: the sampled token's logprob, the top-k logprobs (descending),
    then the top-k token ids (exact in float64), packed so one copy brings them to the host.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    parts = [lp.gather(1, tokens[:, None]).double()]
    if k:
        vals, ids = lp.topk(k, dim=-1)
        parts += [vals.double(), ids.double()]
    return torch.cat(parts, dim=1)


# ------------------------------------------------------------------ a batch of requests

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
