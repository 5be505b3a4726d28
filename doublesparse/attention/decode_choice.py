"""Why a request decoded densely: the :class:`~.budget.DecodePolicy` decision for one length, in
words, for ``doublesparse generate`` to print."""

from __future__ import annotations

from .budget import DENSE, DecodePolicy

_MAX_SEARCH = 1 << 24


def sparse_from(policy: DecodePolicy, limit: int) -> int | None:
    """The shortest length (tokens in the cache, alone in its step) from which ``policy`` decodes
    a request sparsely, searched up to ``limit``; None if it never does by then. Assumes the
    choice, once sparse, stays sparse for longer requests (true of the budget and the cost model:
    the bytes saved grow with the length)."""
    limit = min(limit, _MAX_SEARCH)
    if not _sparse(policy, limit):
        return None
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi) // 2
        if _sparse(policy, mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _sparse(policy: DecodePolicy, n: int) -> bool:
    ks, _ = policy.plan([n])
    return ks[0] != DENSE


def dense_reason(policy: DecodePolicy, n: int, max_context: int) -> str | None:
    """Why a request holding ``n`` tokens (alone in its step) decodes densely under ``policy``, or
    None when it decodes sparsely. ``max_context``: the longest request the engine takes."""
    if _sparse(policy, n):
        return None
    k = policy.budget.k_for(n)
    start = sparse_from(policy, max_context)
    tail = (f"; this model and setting decode sparsely from {start} tokens" if start is not None
            else f"; no request up to the context length ({max_context}) decodes sparsely here")
    if n <= k:
        return (f"the request held {n} tokens, not more than its top-k ({k}): attending to all of "
                f"them reads no more than sparse decode would{tail}")
    if policy.threshold is not None:
        return (f"the request held {n} tokens, below --ds-sparse-decode-threshold "
                f"{policy.threshold}{tail}")
    c = policy.cost
    saved = c.saving_s(n, k)
    return (f"at {n} tokens sparse decode would save {saved * 1e6:.0f} us of reads per step, no "
            f"more than the {c.sparse_step_overhead_s * 1e6:.0f} us its extra launches add "
            f"(--ds-sparse-decode-threshold auto){tail}; --ds-sparse-decode-threshold N forces "
            "sparse decode from N tokens")
