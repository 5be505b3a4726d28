"""Prompt logprobs: each prompt token's log-probability given the tokens before it, read off the
prefill's logits for the requests that ask (``SamplingParams.prompt_logprobs``).

A prefill chunk ``[start, end)`` of such a request returns logits at every one of its positions
(``ModelRunner.prefill(all_logits=...)``); position ``p`` predicts prompt token ``p + 1``, so the
chunk scores tokens ``start + 1 .. min(end, L - 1)`` (``L``: the prompt's length), and its last
position, when the prompt ends there, is the one the first output token is sampled from. The
prefill attends densely whether or not Double Sparsity is on (DS selects tokens for decode only),
so the numbers are the dense model's. Such requests skip the prefix cache (a cached prefix has
no logits to score it with; see ``Engine.add_request``).

Nothing here runs for a step whose requests did not ask: the engine calls :func:`split` only when
one did, and the logprobs reach the host through their own asynchronous copy, waited on with the
step's tokens (no extra host sync).
"""

from __future__ import annotations

import torch

from .sampler import LOGPROB_COLS, token_logprobs, unpack_logprobs
from .sampling_params import LOGPROBS_MAX
from ..kernels.transfer import to_device

# Rows of the log-softmax computed at once: bounds the [rows, V] float32 temporaries of a long
# chunk (the logits themselves are [chunk tokens, V] already).
_BLOCK = 1024


def wants(r) -> bool:
    return r.params.prompt_logprobs is not None


def split(logits: torch.Tensor, reqs: list, chunks: list, sampled: list[bool]):
    """Separate a prefill's logits into the rows to sample and the prompt logprobs.

    logits [N, V] float32 from ``ModelRunner.prefill`` with ``all_logits[i] = wants(reqs[i])`` and
    ``want_logits = sampled``; ``chunks[i]`` (a ``PrefillChunk``) is ``reqs[i]``'s. Returns
    (logits to sample [sum(sampled), V], packed logprobs [M, LOGPROB_COLS] float64 on the
    device or None when M = 0, spans: [(request, rows of it among the M)] in order).
    """
    sel, pieces, spans = [], [], []
    off = 0
    for r, c, s in zip(reqs, chunks, sampled):
        if not wants(r):
            if s:
                sel.append(off)
                off += 1
            continue
        n = c.end - c.start
        m = min(c.end, len(r.prompt_ids) - 1) - c.start  # positions that predict a prompt token
        for i in range(0, m, _BLOCK):  # views of the logits: no [M, V] copy
            j = min(m, i + _BLOCK)
            pieces.append((off + i, off + j, r.prompt_ids[c.start + 1 + i:c.start + 1 + j]))
        spans.append((r, m))
        if s:
            sel.append(off + n - 1)
        off += n
    dev = logits.device
    sample_logits = logits[to_device(torch.tensor(sel, dtype=torch.int64), dev)]
    if not pieces:
        return sample_logits, None, spans
    packed = torch.cat([token_logprobs(logits[a:b], to_device(torch.tensor(t, dtype=torch.int64), dev),
                                       LOGPROBS_MAX) for a, b, t in pieces])
    assert packed.shape[1] == LOGPROB_COLS
    return sample_logits, packed, spans


def attach(rows: list[list[float]], spans: list) -> None:
    """Hand the host rows of :func:`split`'s packed logprobs to their requests, in order (a
    request that ended meanwhile, or already had its list sent, drops them)."""
    i = 0
    for r, m in spans:
        if r.prompt_logprobs is not None and r.finish_reason is None:
            k = r.params.prompt_logprobs
            r.prompt_logprobs.extend(unpack_logprobs(rows[j], k) for j in range(i, i + m))
        i += m
