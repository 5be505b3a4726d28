"""The operating point: how many label channels, how many tokens, which selection, per model.

A Double Sparsity decode is set by a few real choices: the label channels r, the token budget
(a ratio of each request's length and its floor, optionally cut further by a top-p mass), each
layer's selection mode and the sink/recent tokens forced into the selection. ``doublesparse
calibrate`` measures the output (KL to dense, top-1 agreement) of candidate points on held-apart
text and records the cheapest one whose KL stays under a target in the channel config under
:data:`OP_KEY` (other readers ignore the key). A model without one gets :func:`shape_default`.

The engine takes every field the user left unset (``None`` in :class:`~doublesparse.config.EngineConfig`,
``auto`` for the selection mode) from the point (:meth:`OperatingPoint.fill`); flags the user set win.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ..config import SELECTION_MODES, EngineConfig

OP_KEY = "doublesparse_operating_point"
OP_VERSION = 1
SOURCES = ("calibrated", "shape default")
# the EngineConfig fields a point fills, under these names in the config's "chosen" object
POINT_FIELDS = ("ds_heavy_channel_num", "ds_heavy_token_ratio", "ds_heavy_token_min",
                "ds_selection_mode", "ds_num_sink", "ds_num_recent", "ds_budget_top_p")
# the measured evidence of the shape rule (docs/accuracy.md, "Operating point"): group_max was the
# better selection on SmolLM2-135M (query group 3) and Qwen2.5-Coder-1.5B (group 6); group_sum on
# Qwen2.5-0.5B (group 7); the 1.5B needed 4x SmolLM2's token ratio for the same KL
GROUP_MAX_WIDEST = 6
NARROW_GROUP = 4


@dataclass(frozen=True)
class OperatingPoint:
    """One model's Double Sparsity defaults and where they came from.

    heavy_channel_num: label channels r. token_ratio / token_min: each request's k =
    max(token_min, ceil(token_ratio x length)). selection: one mode for every layer
    ("group_max", "group_sum", "per_head") or "per_layer" (``layer_modes``: the config's recorded
    ``ds_mode`` keys). num_sink / num_recent: forced first / last tokens (at most k/8, k/4).
    top_p: 0, or the top-p budget's mass (k is then each KV head's upper bound, token_min its
    lower one). source: "calibrated" (measured, from the channel config) or "shape default".
    kl_target: the KL(dense || DS) in nats per token the calibration held the point under; measured:
    what it measured for the point (kl, top1, bytes_fraction, seq_len, ...); rule: how a shape
    default was derived.
    """

    heavy_channel_num: int
    token_ratio: float
    token_min: int
    selection: str
    num_sink: int = 4
    num_recent: int = 32
    top_p: float = 0.0
    source: str = "shape default"
    layer_modes: tuple[str, ...] = ()
    kl_target: float | None = None
    measured: dict = field(default_factory=dict, compare=False)
    rule: str = ""

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"operating point source must be one of {SOURCES}, got {self.source!r}")
        if self.selection not in SELECTION_MODES + ("per_layer",):
            raise ValueError(f"operating point selection must be one of {SELECTION_MODES + ('per_layer',)}, "
                             f"got {self.selection!r}")
        if self.selection == "per_layer" and not self.layer_modes:
            raise ValueError("operating point selection 'per_layer' needs the config's per-layer ds_mode keys")

    @property
    def sink_recent(self) -> tuple[int, int]:
        """(sink, recent) before the scaling to small budgets."""
        return self.num_sink, self.num_recent

    def modes(self, num_layers: int) -> tuple[str, ...]:
        """Each layer's selection mode."""
        if self.layer_modes:
            return tuple(self.layer_modes)
        return (self.selection,) * num_layers

    def fill(self, cfg: EngineConfig) -> EngineConfig:
        """``cfg`` with every Double Sparsity field the user left unset taken from this point
        (the user's own config object is not changed). Sink and recent counts are not filled in:
        unset, they scale down with small budgets (``EngineConfig.sink_recent``, whose default
        :attr:`sink_recent` gives)."""
        kw: dict[str, Any] = {}
        for name, val in (("ds_heavy_channel_num", self.heavy_channel_num),
                          ("ds_heavy_token_ratio", self.token_ratio), ("ds_heavy_token_min", self.token_min)):
            if getattr(cfg, name) is None:
                kw[name] = val
        # DS-Offload runs no top-p budget: there the point's upper bound is every request's k
        if self.top_p and cfg.ds_budget_mode is None and cfg.ds_heavy_token_num is None and not cfg.enable_ds_offload:
            kw["ds_budget_mode"] = "top_p"
            if cfg.ds_budget_top_p is None:
                kw["ds_budget_top_p"] = self.top_p
        return cfg.replace(**kw) if kw else cfg

    def overridden(self, cfg: EngineConfig) -> dict[str, Any]:
        """The point's fields the user set differently (flag name -> the user's value)."""
        out = {}
        for name, val in (("ds_heavy_channel_num", self.heavy_channel_num),
                          ("ds_heavy_token_ratio", self.token_ratio), ("ds_heavy_token_min", self.token_min),
                          ("ds_num_sink", self.num_sink), ("ds_num_recent", self.num_recent)):
            got = getattr(cfg, name)
            if got is not None and got != val:
                out[name] = got
        if cfg.ds_selection_mode != "auto" and cfg.ds_selection_mode != self.selection:
            out["ds_selection_mode"] = cfg.ds_selection_mode
        if cfg.ds_heavy_token_num is not None:
            out["ds_heavy_token_num"] = cfg.ds_heavy_token_num
        if cfg.ds_budget_mode is not None and (cfg.ds_budget_mode == "top_p") != bool(self.top_p):
            out["ds_budget_mode"] = cfg.ds_budget_mode
        if self.top_p and cfg.ds_budget_top_p is not None and cfg.ds_budget_top_p != self.top_p:
            out["ds_budget_top_p"] = cfg.ds_budget_top_p
        return out

    def describe(self) -> str:
        """One line: what the point is and where it came from."""
        mode = self.selection
        if self.selection == "per_layer":
            counts = {m: self.layer_modes.count(m) for m in dict.fromkeys(self.layer_modes)}
            mode = "per layer (" + ", ".join(f"{m} x{n}" for m, n in counts.items()) + ")"
        s = (f"r={self.heavy_channel_num}, k=1/{1 / self.token_ratio:g} of the length (at least "
             f"{self.token_min})" + (f", top-p {self.top_p:g}" if self.top_p else "")
             + f", {mode}, sink {self.num_sink} + recent {self.num_recent}")
        if self.source == "calibrated":
            m = self.measured
            how = "calibrated"
            if m.get("kl") is not None and self.kl_target is not None:
                how += (f": KL {m['kl']:.4f} (target {self.kl_target:g}), top-1 {m.get('top1', float('nan')):.3f}"
                        f" at {m.get('seq_len')} tokens, {m.get('bytes_fraction', float('nan')):.3f} x dense bytes")
            return f"operating point {how}; {s}"
        return f"operating point from the model's shape ({self.rule}); {s}"

    def as_dict(self, cfg: EngineConfig | None = None) -> dict[str, Any]:
        """A JSON-able summary; with ``cfg`` (the user's), also the flags that override the point."""
        d = {"source": self.source, "heavy_channel_num": self.heavy_channel_num,
             "token_ratio": self.token_ratio, "token_min": self.token_min, "selection": self.selection,
             "num_sink": self.num_sink, "num_recent": self.num_recent, "top_p": self.top_p,
             "kl_target": self.kl_target, "measured": dict(self.measured) or None,
             "rule": self.rule or None, "summary": self.describe()}
        if self.layer_modes:
            d["modes"] = {m: self.layer_modes.count(m) for m in dict.fromkeys(self.layer_modes)}
        if cfg is not None:
            d["overridden"] = self.overridden(cfg)
        return d


def shape_default(num_q_heads: int, num_kv_heads: int, head_dim: int, latent: bool = False) -> OperatingPoint:
    """The point of a model without a calibrated one, from its shape: what calibration chose on
    the models measured (docs/accuracy.md, "Operating point"; KL target 0.015 at 8K tokens):

    - r = head_dim / 4 for wide query groups (Qwen2.5-Coder-1.5B, head_dim 128: 32; at equal bytes
      it did better than half or twice as many channels), min(16, head_dim / 4) for narrow ones
      (SmolLM2-135M, head_dim 64: 16, measured; narrow groups of head_dim 128, the Llama-3 class,
      are not measured yet, so they keep the r their measured speedups were taken with);
    - k = 1/16 of the length, at least 512, for query groups of up to :data:`NARROW_GROUP` heads
      (SmolLM2, group 3); 1/4, at least 2048, for wider ones (the 1.5B, group 6: one token set
      serves more heads); the floor is the k those points were measured with (at 8K);
    - ``group_max`` up to query groups of :data:`GROUP_MAX_WIDEST`, ``group_sum`` beyond (a max
      over many heads keeps the tokens one head wants sharply and loses those the group shares);
    - 4 sink + 32 recent tokens.

    ``latent``: an MLA model (one latent row per token, ``head_dim`` its width), where none of this
    was measured: the engine's former defaults (r = min(16, head_dim/4), 1/16 at least 512, group_max).
    """
    if latent:
        return OperatingPoint(min(16, max(1, head_dim // 4)), 1 / 16, 512, "group_max",
                              rule=f"MLA latent rows of {head_dim}: not measured, the former defaults")
    g = max(1, num_q_heads // max(1, num_kv_heads))
    narrow = g <= NARROW_GROUP
    r = max(1, head_dim // 4) if not narrow else min(16, max(1, head_dim // 4))
    ratio, floor = (1 / 16, 512) if narrow else (1 / 4, 2048)
    mode = "group_max" if g <= GROUP_MAX_WIDEST else "group_sum"
    rule = f"query group {g}, head_dim {head_dim}"
    return OperatingPoint(r, ratio, floor, mode, rule=rule)


def _num(d: dict, key: str, kind, lo, hi, where: str):
    v = d.get(key)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or float(v).is_integer())
    if not ok or not lo <= v <= hi or (isinstance(v, float) and math.isnan(v)):
        raise ValueError(f"{where}: {key!r} must be a{'n integer' if kind is int else ' number'} in "
                         f"[{lo}, {hi}], got {v!r}")
    return kind(v)


def from_config(cfg: dict, num_layers: int, head_dim: int,
                recorded: tuple[str, ...] | None = None) -> OperatingPoint | None:
    """The calibrated point a channel config records under :data:`OP_KEY`, or None without one.
    ``recorded``: the config's per-layer ``ds_mode`` keys (a "per_layer" point runs them).
    A malformed entry is refused with the offending field named."""
    raw = cfg.get(OP_KEY)
    if raw is None:
        return None
    where = f"channel config {OP_KEY!r}"
    if not isinstance(raw, dict) or not isinstance(raw.get("chosen"), dict):
        raise ValueError(f"{where}: expected an object with a 'chosen' object")
    c = raw["chosen"]
    w = f"{where}['chosen']"
    r = _num(c, "ds_heavy_channel_num", int, 1, head_dim, w)
    ratio = _num(c, "ds_heavy_token_ratio", float, 1e-9, 1.0, w)
    floor = _num(c, "ds_heavy_token_min", int, 1, 1 << 40, w)
    sink = _num(c, "ds_num_sink", int, 0, 1 << 20, w)
    recent = _num(c, "ds_num_recent", int, 0, 1 << 20, w)
    top_p = _num(c, "ds_budget_top_p", float, 0.0, 1.0, w) if "ds_budget_top_p" in c else 0.0
    mode = c.get("ds_selection_mode")
    if mode not in SELECTION_MODES + ("per_layer",):
        raise ValueError(f"{w}: 'ds_selection_mode' must be one of {SELECTION_MODES + ('per_layer',)}, got {mode!r}")
    layer_modes: tuple[str, ...] = ()
    if mode == "per_layer":
        if not recorded or len(recorded) != num_layers:
            raise ValueError(f"{w}: 'ds_selection_mode' is 'per_layer' but the config records no "
                             f"ds_mode for its {num_layers} layers")
        layer_modes = tuple(recorded)
    target = raw.get("kl_target")
    if target is not None:
        target = _num(raw, "kl_target", float, 0.0, 1e9, where)
    measured = {k: c[k] for k in ("kl", "top1", "ppl_increase_pct", "bytes_fraction", "setting") if k in c}
    on = raw.get("measured_on") or {}
    if isinstance(on, dict) and "seq_len" in on:
        measured["seq_len"] = on["seq_len"]
    return OperatingPoint(r, ratio, floor, mode, sink, recent, top_p, "calibrated", layer_modes, target,
                          measured)


def resolve(channel_cfg: dict | None, num_q_heads: int, num_kv_heads: int, head_dim: int,
            num_layers: int, recorded: tuple[str, ...] | None = None, latent: bool = False) -> OperatingPoint:
    """The calibrated point of ``channel_cfg`` if it records one, else the shape default (with
    the config's recorded per-layer modes, where it has them: they were measured); ``latent``:
    an MLA model (see :func:`shape_default`)."""
    point = from_config(channel_cfg, num_layers, head_dim, recorded) if channel_cfg else None
    if point is not None:
        return point
    point = shape_default(num_q_heads, num_kv_heads, head_dim, latent)
    if recorded and len(recorded) == num_layers:
        mode = recorded[0] if len(set(recorded)) == 1 else "per_layer"
        point = replace(point, selection=mode, layer_modes=tuple(recorded) if mode == "per_layer" else (),
                        rule=point.rule + "; modes from the channel config")
    return point


__all__ = ["OP_KEY", "OP_VERSION", "POINT_FIELDS", "GROUP_MAX_WIDEST", "NARROW_GROUP", "OperatingPoint",
           "shape_default",
           "from_config", "resolve"]
