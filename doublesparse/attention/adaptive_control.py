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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_TARGET_RECALL = 0.95
# moves in one direction after which a layer gets one level of step and window back
RECOVER_AFTER = 3


@dataclass(frozen=True)
class AdaptiveConfig:
    """target: the recall each layer's budget aims at; window: fresh samples of a layer per
    decision (up to ``max_window_factor`` x that after reversals); step / min_step: the first and
    the smallest relative change of a scale in one decision; min_scale / max_scale: bounds of every layer's scale (the workspace holds
    ``max_scale`` x the budget's largest k); margin: a layer's scale is lowered only when its
    mean recall exceeds ``target + margin`` (None: half of ``1 - target``)."""

    target: float = DEFAULT_TARGET_RECALL
    window: int = 8
    max_window_factor: int = 8
    step: float = 0.25
    min_step: float = 0.02
    min_scale: float = 0.25
    max_scale: float = 2.0
    margin: float | None = None

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

    def __init__(self, cfg: AdaptiveConfig, max_scales: list[float]):
        self.cfg = cfg
        self.max_scales = [max(cfg.min_scale, min(cfg.max_scale, m)) for m in max_scales]
        L = len(max_scales)
        self.scales = [min(1.0, m) for m in self.max_scales]
        self.steps = [cfg.step] * L
        self.windows = [cfg.window] * L
        self.run = [0] * L   # moves in the same direction since the last reversal
        self.last_dir = [0] * L
        self.changes = [0] * L
        self.reversals = [0] * L
        self.last_mean: list[float | None] = [None] * L
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

    def _decide(self, layer: int, mean: float) -> bool:
        cfg = self.cfg
        d = 1 if mean < cfg.target else (-1 if mean > cfg.upper else 0)
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
        return True

    def summary(self) -> dict:
        """JSON-able: the target, each layer's scale, bound, last decided mean recall, changes."""
        return {"target_recall": self.cfg.target, "scales": list(self.scales),
                "max_scales": list(self.max_scales), "min_scale": self.cfg.min_scale,
                "last_recall": list(self.last_mean), "windows": list(self.windows),
                "changes": sum(self.changes),
                "reversals": sum(self.reversals)}
