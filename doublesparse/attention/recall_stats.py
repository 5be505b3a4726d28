"""Host-side tallies of the sampled attention recall (attention/recall.py): per layer, per layer
group (a histogram), per model, and per request row until its request finishes.

Every figure here comes from results already copied to the host; nothing reads the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Upper edges of the recall histogram's buckets (Prometheus ``le``); the last is +Inf. Dense near
# 1 because that is where a working budget lives: 0.9 vs 0.99 is the difference that matters.
RECALL_BUCKETS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999, 1.0)


def layer_groups(num_layers: int, groups: int) -> list[tuple[int, int]]:
    """``groups`` near-equal runs of consecutive layers ``[(first, last), ...]`` (fewer when there
    are fewer layers)."""
    groups = max(1, min(groups, num_layers))
    edges = [round(i * num_layers / groups) for i in range(groups + 1)]
    return [(a, b - 1) for a, b in zip(edges, edges[1:]) if b > a]


@dataclass
class _Tally:
    count: int = 0
    recall_sum: float = 0.0
    recall_min: float = math.inf
    error_sum: float = 0.0

    def add(self, recall: float, error: float) -> None:
        self.count += 1
        self.recall_sum += recall
        self.recall_min = min(self.recall_min, recall)
        self.error_sum += error

    def as_dict(self) -> dict:
        if not self.count:
            return {"samples": 0, "recall_mean": None, "recall_min": None, "rel_error_mean": None}
        return {"samples": self.count, "recall_mean": self.recall_sum / self.count,
                "recall_min": self.recall_min, "rel_error_mean": self.error_sum / self.count}


class RecallStats:
    """Tallies of (layer, request row, recall, output relative error) samples."""

    def __init__(self, num_layers: int, groups: int):
        self.groups = layer_groups(num_layers, groups)
        self._group_of = [next(g for g, (a, b) in enumerate(self.groups) if a <= i <= b)
                          for i in range(num_layers)]
        self.layers = [_Tally() for _ in range(num_layers)]
        self.model = _Tally()
        self.buckets = [[0] * (len(RECALL_BUCKETS) + 1) for _ in self.groups]  # not cumulative
        self.group_sum = [0.0] * len(self.groups)
        self.rows: dict[int, _Tally] = {}
        # per layer: an exponential moving average of its recall (the adaptive budget's input)
        self.ema: list[float | None] = [None] * num_layers

    def add(self, layer: int, row: int | None, recall: float, error: float, ema_weight: float = 0.1) -> None:
        self.layers[layer].add(recall, error)
        self.model.add(recall, error)
        g = self._group_of[layer]
        self.buckets[g][next((j for j, e in enumerate(RECALL_BUCKETS) if recall <= e),
                             len(RECALL_BUCKETS))] += 1
        self.group_sum[g] += recall
        if row is not None:
            self.rows.setdefault(row, _Tally()).add(recall, error)
        old = self.ema[layer]
        self.ema[layer] = recall if old is None else old + ema_weight * (recall - old)

    def take_row(self, row: int) -> dict:
        """The samples of request row ``row`` since it was last taken (its request's), and forget them."""
        return self.rows.pop(row, _Tally()).as_dict()

    def group_name(self, g: int) -> str:
        a, b = self.groups[g]
        return f"{a}-{b}" if b > a else str(a)

    def summary(self) -> dict:
        """JSON-able: the model's tally, each group's histogram (cumulative counts per upper edge,
        the last +Inf) and sum, each layer's mean (None: not sampled yet)."""
        groups = []
        for g in range(len(self.groups)):
            cum, acc = [], 0
            for c in self.buckets[g]:
                acc += c
                cum.append(acc)
            groups.append({"layers": self.group_name(g), "buckets": list(RECALL_BUCKETS),
                           "cumulative_counts": cum, "count": acc, "sum": self.group_sum[g]})
        return {**self.model.as_dict(), "groups": groups,
                "layers": [t.recall_sum / t.count if t.count else None for t in self.layers]}
