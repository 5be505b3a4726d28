"""How many tokens each request attends to, and whether a decode step runs sparse at all.

Two questions, both answered on the host from lengths it already knows (no device sync):

* The budget of one request: ``k = clamp(ceil(ratio * n), k_min, k_max)`` for a request holding n
  tokens, or one fixed k (SGLang's ``--ds-heavy-token-num``). A request with ``n <= k`` attends
  to everything: sparse decode would read more than dense. With ``top_p`` that k is an upper
  bound: on the device, each selection row (KV head) of each step then keeps the smallest part of
  its k selected tokens whose estimated attention weight reaches ``top_p``, at least ``k_min``
  (``ops.ds_decode``; the host never learns the counts).
* Whether the step decodes sparsely: with a fixed ``--ds-sparse-decode-threshold`` (SGLang's
  meaning), every request with ``n >= threshold`` and ``n > k`` does. With ``auto``, a cost model
  compares the bytes each path reads with the fixed time the sparse path's extra launches add to
  a step: a request is sparse only if it reads fewer bytes that way, and the step is sparse only
  if the bytes the batch saves take longer to read than that fixed time. Otherwise the step runs
  the dense launches (the labels of its new tokens are still written).

The result of :meth:`DecodePolicy.plan` is one k per request, with :data:`DENSE` for a request
that decodes densely; the kernels decode a row sparsely iff its length exceeds its k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DENSE = 2**31 - 1  # a budget no length exceeds: the row attends to every token


# adaptive: the ratio budget with per-layer scales that follow the sampled recall (attention/adaptive.py)
BUDGET_MODES = ("fixed", "ratio", "top_p", "adaptive")


@dataclass(frozen=True)
class TokenBudget:
    """``k(n) = clamp(ceil(ratio * n), k_min, k_max)``; ``ratio == 0``: always ``k_max``.
    ``top_p`` in (0, 1]: k(n) is each row's upper bound and ``k_min`` its lower bound on the
    device (0: off)."""

    k_min: int
    k_max: int
    ratio: float = 0.0
    top_p: float = 0.0

    def __post_init__(self):
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got k_min={self.k_min}, k_max={self.k_max}")
        if not 0.0 <= self.ratio <= 1.0 or math.isnan(self.ratio):
            raise ValueError(f"the token ratio must be in [0, 1], got {self.ratio}")
        if not 0.0 <= self.top_p <= 1.0 or math.isnan(self.top_p):
            raise ValueError(f"top_p must be in (0, 1] (0: off), got {self.top_p}")

    @classmethod
    def fixed(cls, k: int) -> "TokenBudget":
        return cls(k, k, 0.0)

    def k_for(self, n: int) -> int:
        if self.ratio == 0.0:
            return self.k_max
        return max(self.k_min, min(self.k_max, math.ceil(n * self.ratio)))

    @property
    def mode(self) -> str:
        if self.top_p > 0:
            return "top_p"
        return "ratio" if self.ratio else "fixed"

    def describe(self) -> str:
        if self.ratio == 0.0:
            s = f"top-{self.k_max} tokens"
        else:
            s = f"top-ceil({self.ratio:g} x length) tokens, clamped to [{self.k_min}, {self.k_max}]"
        if self.top_p > 0:
            s += (f", per KV head cut to the fewest reaching {self.top_p:g} of the estimated "
                  f"attention (at least {self.k_min})")
        return s


@dataclass(frozen=True)
class DecodeCost:
    """What one decode step reads per request on each path, summed over layers, and the fixed
    time the sparse path adds to a step (its extra launches: score, select, sparse attention).

    kv_bytes_per_token: K and V of one token (dense reads all of them). label_bytes_per_token:
    its labels (sparse scores all of them). selected_bytes_per_token: the K and V rows sparse
    attention reads per selected token (more than kv_bytes_per_token where every query head
    selects its own tokens). bandwidth: bytes/s the decode kernels reach.
    """

    kv_bytes_per_token: int
    label_bytes_per_token: int
    selected_bytes_per_token: int
    bandwidth: float
    sparse_step_overhead_s: float

    def saving_s(self, n: int, k: int) -> float:
        """Seconds of reads that sparse decode saves on a request of n tokens with budget k."""
        dense = n * self.kv_bytes_per_token
        sparse = n * self.label_bytes_per_token + min(k, n) * self.selected_bytes_per_token
        return (dense - sparse) / self.bandwidth


@dataclass(frozen=True)
class DecodePolicy:
    """threshold: an int keeps SGLang's meaning (sparse iff n >= threshold, and n > k); None is
    ``auto`` (the cost model decides; it needs ``cost``)."""

    budget: TokenBudget
    threshold: int | None = None
    cost: DecodeCost | None = None

    def __post_init__(self):
        if self.threshold is None and self.cost is None:
            raise ValueError("the automatic dense/sparse choice needs a DecodeCost")

    def plan(self, lengths: list[int]) -> tuple[list[int], bool]:
        """Per request (n tokens in the cache after this step): its k, or DENSE; and whether any
        request of the step decodes sparsely."""
        ks = [self.budget.k_for(n) for n in lengths]
        if self.threshold is not None:
            out = [k if n > k and n >= self.threshold else DENSE for n, k in zip(lengths, ks)]
            return out, any(k != DENSE for k in out)
        saves = [self.cost.saving_s(n, k) if n > k else 0.0 for n, k in zip(lengths, ks)]
        if sum(s for s in saves if s > 0) <= self.cost.sparse_step_overhead_s:
            return [DENSE] * len(lengths), False
        out = [k if s > 0 else DENSE for k, s in zip(ks, saves)]
        return out, True

    def sparse_rows(self, lengths: list[int]) -> list[bool]:
        ks, _ = self.plan(lengths)
        return [k != DENSE for k in ks]

    def describe(self) -> str:
        choice = ("auto (cost model)" if self.threshold is None
                  else f"requests of at least {self.threshold} tokens")
        return f"{self.budget.describe()}; sparse decode: {choice}"
