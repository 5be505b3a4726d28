"""Calibration's last stage: the operating point chosen by measuring the output.

Candidate points are decoded through the real decode path (``eval.measure.TextRunner``: dense
prefill, then every scored token through ``ops.ds_decode`` on real KV/label pools; PyTorch on a
CPU, Triton on a GPU) on held-apart calibration text: windows of ``seq_len`` tokens of the
calibration plays that overlap none of the channel statistics' windows. Each candidate's
KL(dense || DS) per token, top-1 agreement and perplexity are measured against dense on the same
tokens, and its cost is the bytes one decode step reads (``Setting.bytes_per_step``, K/V and
labels at 2 bytes) as a fraction of dense. The point is the cheapest candidate whose KL stays
under the target (ties: lower KL, then higher top-1), found in four stages:

1. selection: at r = min(16, head_dim/4) and k = 1/16 of the length, each selection (group_max
   and group_sum on every layer, and the per-layer modes chosen by attention recall where they
   mix) with each sink/recent choice; all read the same bytes, so the lowest KL wins;
2. budget: that selection at every r of :func:`channel_options` and every ratio of
   :data:`RATIOS`, cheapest first, up to the first bytes level under the target (every one with
   ``full_grid``);
3. the other selections at the chosen budget (equal bytes: one with a lower KL replaces it);
4. the top-p budget around it: twice its k as each KV head's upper bound, half as the lower,
   at each mass of :data:`TOP_PS` (bytes as measured: the tokens actually attended to).

Budgets are measured without a floor (k = ratio x ``seq_len``); the point's floor is the k it was
measured with, so a shorter request attends to at least as many tokens as measured, of fewer.
At a fixed ratio the KL falls as the context grows (docs/accuracy.md, "Operating point"), so a
point measured at ``seq_len`` is conservative for longer requests.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from ..channels import parse_channels
from ..engine.operating_point import OP_VERSION
from ..eval.settings import DENSE, Setting
from .threads import num_threads

# ln(1.015) = 0.0149: over scored tokens, the mean KL(dense || DS) tracks the log of the
# perplexity ratio (docs/accuracy.md), so the target holds perplexity to about +1.5 %
KL_TARGET = 0.015
# measured windows: as long as a GPU measures in a minute or two; on a CPU half that (a 1.5B
# model's 8K prefill and 24 points took 30 min on 2 cores)
SEQ_LEN_GPU, SEQ_LEN_CPU, NUM_WINDOWS, DECODE_LEN = 16384, 8192, 2, 128
RATIOS = (1 / 32, 1 / 16, 1 / 8, 1 / 4)
REFERENCE_RATIO = 1 / 16
SINK_RECENT = ((4, 32), (8, 64))
TOP_PS = (0.9, 0.95)
CHANNEL_TYPE = "qk"
RULE = ("the fewest bytes per decode step whose KL(dense || DS) <= kl_target; ties: lower KL, then "
        "higher top-1")


@dataclass(frozen=True)
class OpSettings:
    """How the point is measured: ``kl_target`` nats per token; ``num_windows`` windows of
    ``seq_len`` tokens (None: :data:`SEQ_LEN_GPU` on a GPU, :data:`SEQ_LEN_CPU` on a CPU; capped
    at the model's context, :meth:`length`), the last ``decode_len - 1`` of each decoded and
    scored; ``full_grid``: measure every budget, not only up to the cheapest under the target."""

    kl_target: float = KL_TARGET
    seq_len: int | None = None
    num_windows: int = NUM_WINDOWS
    decode_len: int = DECODE_LEN
    full_grid: bool = False

    def __post_init__(self):
        if not (isinstance(self.kl_target, (int, float)) and 0 < self.kl_target < math.inf):
            raise ValueError(f"kl_target must be a positive number, got {self.kl_target!r}")
        for name in ("seq_len", "num_windows", "decode_len"):
            v = getattr(self, name)
            if (v is not None or name != "seq_len") and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.decode_len < 2 or self.decode_len >= (self.seq_len or SEQ_LEN_CPU):
            raise ValueError(f"decode_len must be in [2, seq_len), got {self.decode_len} for seq_len {self.seq_len}")

    def length(self, device, max_context: int) -> int:
        """The measured windows' length on ``device`` for a model of ``max_context`` tokens."""
        n = self.seq_len or (SEQ_LEN_GPU if torch.device(device).type == "cuda" else SEQ_LEN_CPU)
        return min(n, int(max_context))

    def key(self) -> dict:
        return {"kl_target": self.kl_target, "seq_len": self.seq_len, "num_windows": self.num_windows,
                "decode_len": self.decode_len, "full_grid": self.full_grid}


@dataclass(frozen=True)
class Measured:
    """One candidate's measurement; ``avg_k``: tokens attended per selection row (top-p)."""

    setting: Setting
    stage: str
    bytes_fraction: float
    kl: float
    top1: float
    ppl_increase_pct: float
    avg_k: float | None = None

    def row(self) -> dict:
        d = {"setting": self.setting.name, "stage": self.stage, "bytes_fraction": round(self.bytes_fraction, 5),
             "kl": round(self.kl, 5), "top1": round(self.top1, 4),
             "ppl_increase_pct": round(self.ppl_increase_pct, 3)}
        if self.avg_k is not None:
            d["avg_k"] = round(self.avg_k, 1)
        return d


def channel_options(head_dim: int) -> tuple[int, ...]:
    """Label channel counts to try: 8, 16, 32 up to half the head (labels of r channels cost
    r / (2 head_dim) of dense bytes before any token is read)."""
    return tuple(r for r in (8, 16, 32) if r <= head_dim // 2) or (max(1, head_dim // 4),)


def selection_options(recall_modes: tuple[str, ...] | None) -> list[tuple[str, tuple[str, ...]]]:
    """(mode, per-layer modes) pairs: group_max and group_sum everywhere, and the recall's
    per-layer choice where it mixes modes."""
    out: list[tuple[str, tuple[str, ...]]] = [("group_max", ()), ("group_sum", ())]
    if recall_modes and len(set(recall_modes)) > 1:
        out.append(("group_max", tuple(recall_modes)))
    return out


def candidate(selection: tuple[str, tuple[str, ...]], r: int, ratio: float, sink_recent: tuple[int, int],
              top_p: float = 0.0, top_p_min: int = 0) -> Setting:
    mode, layer_modes = selection
    return Setting("ds", CHANNEL_TYPE, mode, r, ratio, num_sink=sink_recent[0], num_recent=sink_recent[1],
                   top_p=top_p, top_p_min=top_p_min, layer_modes=layer_modes)


def _key(m: Measured):
    return (round(m.bytes_fraction, 6), m.kl, -m.top1, m.setting.name)


def cheapest_under(measured, target: float) -> tuple[Measured, bool]:
    """The cheapest measurement with KL <= ``target`` (ties: lower KL, higher top-1, name) and
    True; when none is, the lowest KL (ties: fewer bytes) and False."""
    measured = list(measured)
    if not measured:
        raise ValueError("no candidate was measured")
    under = [m for m in measured if m.kl <= target]
    if under:
        return min(under, key=_key), True
    return min(measured, key=lambda m: (m.kl, round(m.bytes_fraction, 6), m.setting.name)), False


def search(measure: Callable[[Setting, str], Measured], bytes_fraction: Callable[[Setting], float],
           head_dim: int, seq_len: int, recall_modes: tuple[str, ...] | None, op: OpSettings,
           progress=None) -> tuple[Measured, bool, list[Measured]]:
    """Run the four stages (module doc) with ``measure(setting, stage)``; ``bytes_fraction``
    orders the budgets before they are measured. Returns (chosen, target met, every measurement
    in order)."""
    done: dict[Setting, Measured] = {}

    def m(s: Setting, stage: str) -> Measured:
        if s not in done:
            done[s] = measure(s, stage)
            if progress is not None:
                progress.update(1)
        return done[s]

    sels = selection_options(recall_modes)
    r_ref = min(16, max(1, head_dim // 4))
    first = [m(candidate(sel, r_ref, REFERENCE_RATIO, sr), "selection") for sel in sels for sr in SINK_RECENT]
    best = min(first, key=lambda x: (x.kl, -x.top1, x.setting.name)).setting
    sel, sr = (best.mode, best.layer_modes), (best.num_sink, best.num_recent)
    grid = sorted((candidate(sel, r, q, sr) for r in channel_options(head_dim) for q in RATIOS),
                  key=lambda s: (round(bytes_fraction(s), 6), s.name))
    level = None
    for s in grid:
        b = round(bytes_fraction(s), 6)
        if level is not None and b > level and not op.full_grid:
            break
        if m(s, "budget").kl <= op.kl_target and level is None:
            level = b
    chosen, _ = cheapest_under(done.values(), op.kl_target)
    c = chosen.setting
    for s2 in sels:
        for sr2 in SINK_RECENT:
            m(candidate(s2, c.r, c.k_frac, sr2), "selection at the chosen budget")
    chosen, _ = cheapest_under(done.values(), op.kl_target)
    c = chosen.setting
    if not c.top_p:
        k = c.k_for(seq_len)
        for p in TOP_PS:
            m(replace(c, k_frac=min(1.0, 2 * c.k_frac), top_p=p, top_p_min=max(1, k // 2)), "top_p")
    chosen, met = cheapest_under(done.values(), op.kl_target)
    return chosen, met, list(done.values())


def point_record(chosen: Measured, met: bool, measured: list[Measured], op: OpSettings, seq_len: int,
                 measured_on: dict) -> dict:
    """The channel config's operating-point entry (``engine.operating_point.from_config`` reads
    ``chosen`` and ``kl_target``; the rest is the record)."""
    s = chosen.setting
    mode = "per_layer" if s.layer_modes else s.mode
    k = s.k_for(seq_len)
    floor = s.top_p_min if s.top_p else k
    return {"version": OP_VERSION, "kl_target": op.kl_target, "target_met": met, "rule": RULE,
            "chosen": {"ds_heavy_channel_num": s.r, "ds_heavy_token_ratio": s.k_frac, "ds_heavy_token_min": floor,
                       "ds_selection_mode": mode, "ds_num_sink": s.num_sink, "ds_num_recent": s.num_recent,
                       "ds_budget_top_p": s.top_p, **chosen.row()},
            "measured_on": dict(measured_on, seq_len=seq_len, **{k2: v for k2, v in op.key().items()
                                                                 if k2 not in ("kl_target", "seq_len")}),
            "frontier": [x.row() for x in sorted(measured, key=_key)]}


def held_apart_windows(num_ids: int, used: list[tuple[int, int]], seq_len: int, count: int) -> list[int]:
    """Starts of ``count`` windows of ``seq_len`` tokens within ``num_ids`` that overlap none of
    the ``used`` [start, end) ranges, spread over the text."""
    free, pos = [], 0
    for a, b in sorted(used) + [(num_ids, num_ids)]:
        if a - pos >= seq_len:
            free.append((pos, a))
        pos = max(pos, b)
    slots = [s for a, b in free for s in range(a, b - seq_len + 1, seq_len)]
    if len(slots) < count:
        raise ValueError(f"calibration text leaves room for {len(slots)} held-apart windows of {seq_len} "
                         f"tokens beside the statistics' windows, {count} needed: lower the operating "
                         f"point's --op-seq-len / --op-windows or pass more --text")
    return [slots[(2 * i + 1) * len(slots) // (2 * count)] for i in range(count)]


@torch.inference_mode()
def choose_point(model, ids: list[int], used: list[tuple[int, int]], channel_cfg: dict,
                 recall_modes: tuple[str, ...] | None, op: OpSettings, device="cpu", progress: bool = True,
                 cpu_threads: int = 0) -> dict:
    """Measure and choose ``model``'s operating point on ``ids`` (the calibration text's tokens)
    outside the ``used`` ranges; returns :func:`point_record`. On a CPU the decode runs on one
    thread (measured on the 2-core machine: a 4K SmolLM2 setting 5-9 s on one, 40-105 s on two
    under load); the prefill on ``cpu_threads`` (0: torch's count)."""
    from ..eval.measure import TextRunner  # the eval's decode driver: only this stage needs it

    t0 = time.perf_counter()
    c = model.config
    seq_len = op.length(device, int(c.max_position_embeddings))
    starts = held_apart_windows(len(ids), used, seq_len, op.num_windows)
    windows = [ids[s:s + seq_len] for s in starts]
    cache: dict = {}

    def channels_for(s: Setting) -> torch.Tensor:
        key = (s.r, s.layer_modes or s.mode)
        if key not in cache:
            cache[key] = parse_channels(channel_cfg, c, s.channel_type, s.r, s.layer_modes or s.mode)
        return cache[key]

    dims = (int(c.num_layers), int(c.num_q_heads), int(c.num_kv_heads), int(c.head_dim))
    dense_bytes = DENSE.bytes_per_step(seq_len, *dims)
    frac = lambda s, k=None: s.bytes_per_step(seq_len, *dims, k=k) / dense_bytes  # noqa: E731
    on_cpu = torch.device(device).type == "cpu"
    with num_threads(cpu_threads) if on_cpu and cpu_threads else contextlib.nullcontext():
        runner = TextRunner(model, windows, min(op.decode_len, seq_len - 1), channels_for, device)
    decode_threads = num_threads(1) if on_cpu else contextlib.nullcontext()
    bar = tqdm(desc="operating point", unit="point", disable=not progress)
    with decode_threads:
        dense = runner.run(DENSE)

        def measure(s: Setting, stage: str) -> Measured:
            res = runner.run(s)
            avg_k = res.extra.get("avg_k") if s.top_p else None
            return Measured(s, stage, frac(s, avg_k), res.kl, res.top1, 100 * (res.ppl / dense.ppl - 1), avg_k)

        chosen, met, measured = search(measure, frac, int(c.head_dim), seq_len, recall_modes, op, bar)
    bar.close()
    on = {"text": "held-apart windows of the calibration text (none overlaps a channel-statistics window)",
          "window_starts": starts, "scored_tokens": dense.tokens, "dense_ppl": round(dense.ppl, 4),
          "bytes": f"one decode step at {seq_len} tokens, K/V and labels at 2 bytes, as a fraction of dense",
          "budget": "k = ratio x seq_len, no floor; the point's floor is the k it was measured with",
          "seconds": round(time.perf_counter() - t0, 1)}
    return point_record(chosen, met, measured, op, seq_len, on)


__all__ = ["KL_TARGET", "OpSettings", "Measured", "channel_options", "selection_options", "candidate",
           "cheapest_under", "search", "point_record", "held_apart_windows", "choose_point"]
