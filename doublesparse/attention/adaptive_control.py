"""The adaptive budget's controller: each layer's budget scale follows its measured recall.

Host-only arithmetic, no torch: :class:`BudgetController` takes the sampled recall of a layer
(attention/recall.py) and moves that layer's scale of the token budget:

* it decides on the mean of ``window`` fresh samples of the layer, all measured at the scale in
  force (samples from before a change are not mixed in), so one request's odd text moves nothing;
* below the target it raises the scale, above ``target + margin`` (well above) it lowers it, in
  between it holds: the dead band is where a layer settles;
* one decision changes a scale by at most ``step`` (relative); each reversal of direction halves
  that layer's step (down to ``min_step``) and doubles the samples its next decision waits for
  (up to ``max_window_factor`` x ``window``), so traffic that alternates between easy and hard
  texts is averaged over both and the scale settles between them instead of swinging; every
  :data:`RECOVER_AFTER` moves in one direction (the traffic changed for good) give one level back;
* every scale stays in ``[min_scale, max_scale[layer]]``, where the upper bound is the smaller of
  :attr:`AdaptiveConfig.max_scale` (what the decode workspace is sized for) and the layer's cost
  cap (the scale from which that layer would read more with its selection than dense decode).

With ``conserve`` the layers share the ratio budget's bytes instead of each spending what the
target asks, placed where a byte recovers the most attention mass: a layer's need is its missed
mass per byte it reads, ``(1 - recall) / (scale x weight)`` (the mass the next selected token adds
falls with the tokens already selected: for sorted weights decaying as a power of the rank, it
is proportional to this), and a layer whose need is above the layers' (geometric) mean by more
than :data:`NEED_BAND` is raised, one below it by as much lowered. After each move every scale is
multiplied by one factor so that their mean, weighted by each layer's bytes per selected token,
is 1 again (within the bounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_TARGET_RECALL = 0.95
# moves in one direction after which a layer gets one level of step and window back
RECOVER_AFTER = 3
# conserve: a layer's need may differ from the layers' mean by this factor before it is moved
NEED_BAND = 1.3


@dataclass(frozen=True)
class AdaptiveConfig:
    """target: the recall each layer's budget aims at; window: fresh samples of a layer per
    decision (up to ``max_window_factor`` x that after reversals); step / min_step: the first and
    the smallest relative change of a scale in one decision; min_scale / max_scale: bounds of every layer's scale (the workspace holds
    ``max_scale`` x the budget's largest k); margin: a layer's scale is lowered only when its
    mean recall exceeds ``target + margin`` (None: half of ``1 - target``); conserve: hold the
    bytes-weighted mean scale at 1 and move bytes by each layer's missed mass per byte (the
    module docstring; ``target`` and ``margin`` then unused)."""

    target: float = DEFAULT_TARGET_RECALL
    window: int = 8
    max_window_factor: int = 8
    step: float = 0.25
    min_step: float = 0.02
    min_scale: float = 0.25
    max_scale: float = 2.0
    margin: float | None = None
    conserve: bool = False

    def __post_init__(self):
        if not 0.0 < self.target < 1.0 or math.isnan(self.target):
            raise ValueError(f"the target recall must be in (0, 1), got {self.target}")
        if self.window < 1 or self.max_window_factor < 1:
            raise ValueError(f"the adaptive window must be >= 1 samples and its factor >= 1, got "
                             f"{self.window}, {self.max_window_factor}")
        if not 0.0 < self.min_step <= self.step:
            raise ValueError(f"need 0 < min_step <= step, got {self.min_step}, {self.step}")
        if not 0.0 < self.min_scale <= 1.0 <= self.max_scale:
            raise ValueError(f"need 0 < min_scale <= 1 <= max_scale, got {self.min_scale}, {self.max_scale}")
        if self.margin is not None and not 0.0 <= self.margin < 1.0 - self.target:
            raise ValueError(f"the margin must be in [0, 1 - target), got {self.margin}")

    @property
    def upper(self) -> float:
        """The mean recall above which a scale is lowered."""
        return self.target + ((1.0 - self.target) / 2 if self.margin is None else self.margin)


class BudgetController:
    """Per-layer scales of one model's token budget (see the module docstring).

    max_scales: each layer's upper bound (``AdaptiveConfig.max_scale`` capped by its cost cap).
    Feed it with :meth:`add` (one sample) or :meth:`add_mean` (the mean of ``count`` samples);
    :meth:`add` returns whether the layer's scale changed."""

    def __init__(self, cfg: AdaptiveConfig, max_scales: list[float], weights: list[float] | None = None):
        self.cfg = cfg
        self.max_scales = [max(cfg.min_scale, min(cfg.max_scale, m)) for m in max_scales]
        L = len(max_scales)
        # bytes per selected token of each layer (relative): what ``conserve`` holds the mean of
        self.weights = [1.0] * L if weights is None else [float(w) for w in weights]
        if len(self.weights) != L or min(self.weights, default=1.0) <= 0:
            raise ValueError(f"need {L} positive layer weights, got {weights}")
        self.scales = [min(1.0, m) for m in self.max_scales]
        self.steps = [cfg.step] * L
        self.windows = [cfg.window] * L
        self.run = [0] * L   # moves in the same direction since the last reversal
        self.last_dir = [0] * L
        self.changes = [0] * L
        self.reversals = [0] * L
        self.last_mean: list[float | None] = [None] * L
        self.last_need: list[float | None] = [None] * L
        self._sum = [0.0] * L
        self._n = [0] * L

    @property
    def num_layers(self) -> int:
        return len(self.scales)

    def add(self, layer: int, recall: float) -> bool:
        return self.add_mean(layer, recall, 1)

    def add_mean(self, layer: int, mean: float, count: int) -> bool:
        """``count`` samples of ``layer`` whose mean recall is ``mean``, measured at its current
        scale. Returns whether the scale changed (the samples so far are then dropped)."""
        if count <= 0 or math.isnan(mean):
            return False
        self._sum[layer] += mean * count
        self._n[layer] += count
        if self._n[layer] < self.windows[layer]:
            return False
        m = self._sum[layer] / self._n[layer]
        self._sum[layer], self._n[layer] = 0.0, 0
        self.last_mean[layer] = m
        return self._decide(layer, m)

    def _direction(self, layer: int, mean: float) -> int:
        """+1 raise, -1 lower, 0 hold (the module docstring)."""
        cfg = self.cfg
        if not cfg.conserve:
            return 1 if mean < cfg.target else (-1 if mean > cfg.upper else 0)
        self.last_need[layer] = max(1e-6, 1.0 - mean) / (self.scales[layer] * self.weights[layer])
        seen = [n for n in self.last_need if n is not None]
        if len(seen) < 2:
            return 0
        ratio = self.last_need[layer] / math.exp(sum(math.log(n) for n in seen) / len(seen))
        return 1 if ratio > NEED_BAND else (-1 if ratio < 1 / NEED_BAND else 0)

    def _decide(self, layer: int, mean: float) -> bool:
        cfg = self.cfg
        d = self._direction(layer, mean)
        if d == 0:
            return False
        if self.last_dir[layer] and d != self.last_dir[layer]:
            self.steps[layer] = max(cfg.min_step, self.steps[layer] / 2)
            self.windows[layer] = min(cfg.window * cfg.max_window_factor, self.windows[layer] * 2)
            self.reversals[layer] += 1
            self.run[layer] = 0
        elif self.last_dir[layer]:
            self.run[layer] += 1
            if self.run[layer] % RECOVER_AFTER == 0:
                self.steps[layer] = min(cfg.step, self.steps[layer] * 2)
                self.windows[layer] = max(cfg.window, self.windows[layer] // 2)
        self.last_dir[layer] = d
        old = self.scales[layer]
        new = old * (1 + self.steps[layer]) if d > 0 else old / (1 + self.steps[layer])
        new = min(self.max_scales[layer], max(cfg.min_scale, new))
        if new == old:  # at a bound: nothing to move
            return False
        self.scales[layer] = new
        self.changes[layer] += 1
        if cfg.conserve:
            self._rebalance()
        return True

    def mean_scale(self) -> float:
        """The scales' mean weighted by each layer's bytes per selected token."""
        return sum(w * s for w, s in zip(self.weights, self.scales)) / sum(self.weights)

    def _rebalance(self) -> None:
        """Multiply every scale by the one factor (bisected) that brings the weighted mean of the
        scales, each clipped to its bounds, back to 1."""
        lo, hi = self.cfg.min_scale, self.max_scales

        def mean(f):
            return sum(w * min(h, max(lo, s * f)) for w, s, h in zip(self.weights, self.scales, hi)) / sum(self.weights)

        a, b = 1e-3, 1e3
        if not mean(a) <= 1.0 <= mean(b):  # the bounds cannot reach 1: as close as they allow
            f = a if mean(a) > 1.0 else b
        else:
            for _ in range(60):
                f = math.sqrt(a * b)
                a, b = (f, b) if mean(f) < 1.0 else (a, f)
            f = math.sqrt(a * b)
        self.scales = [min(h, max(lo, s * f)) for s, h in zip(self.scales, hi)]

    def summary(self) -> dict:
        """JSON-able: the target, each layer's scale, bound, last decided mean recall, changes."""
        return {"target_recall": self.cfg.target, "conserve": self.cfg.conserve,
                "mean_scale": self.mean_scale(), "scales": list(self.scales),
                "max_scales": list(self.max_scales), "min_scale": self.cfg.min_scale,
                "last_recall": list(self.last_mean), "windows": list(self.windows),
                "changes": sum(self.changes),
                "reversals": sum(self.reversals)}
