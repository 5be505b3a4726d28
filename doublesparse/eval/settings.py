"""What one evaluated decode configuration is, the grids we sweep, and what a step reads.

Bytes per decode step (per request, summed over layers; K/V and bf16 labels counted at 2 bytes,
fp8 labels and the K/V of an fp8 KV cache at 1, as stored on the GPU, whatever dtype a CPU run
uses):

    dense layer          : n * Hkv * D * 2 (K and V) * 2
    double-sparse layer  : labels n * Hkv * r * label_bytes
                           + selected K/V  k * R * D * 2 * 2   (R = Hq for per_head, else Hkv:
                             per_head reads a separate token set per query head)
(the last factor 2 is the K/V value's bytes: 1 with an fp8 KV cache)

n = tokens in the cache, k = heavy tokens (sink and recent tokens are part of the k).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from doublesparse.config import KV_CACHE_DTYPES, LABEL_DTYPES
from doublesparse.engine.memory import LABEL_TORCH_DTYPES

KV_BYTES = 2


def kv_bytes(kv: str) -> int:
    """Bytes of one K or V value as a GPU stores it under ``--kv-cache-dtype kv``."""
    return 1 if kv.startswith("fp8") else KV_BYTES


@dataclass(frozen=True)
class Setting:
    """One decode configuration.

    kind: "dense" (ops.dense_decode) or "ds" (ops.ds_decode).
    channel_type: "q" | "k" | "qk" (which calibration statistic picked the channels).
    mode: "per_head" | "group_sum" | "group_max".
    r: heavy channels per KV head. k_frac: heavy tokens as a fraction of the context length
    (k = max(1, round(k_frac * ctx))), so one setting scales across context lengths; k_min:
    at least that many (the engine's ``--ds-heavy-token-min``), capped at k_max when given.
    num_sink / num_recent: always-kept first / last tokens (counted inside k); like the engine's
    default they are capped at k/8 and k/4 for small k (:meth:`sink_recent`).
    dense_layers: the first layers decode densely.
    label: the label cache's dtype, "bf16" or "fp8" (e4m3, the engine's ``--ds-label-dtype``).
    layer_modes: each layer's mode where they differ (a channel config's calibrated ``ds_mode``
    keys, as the engine's default runs them); empty: ``mode`` on every layer.
    top_p: the top-p budget (the engine's ``--ds-budget-mode top_p --ds-budget-top-p``; 0: off):
    k is then each selection row's upper bound, and each row keeps the fewest of its selected
    tokens whose estimated attention reaches top_p, at least ``top_p_min`` (capped at k; the
    engine's ``--ds-heavy-token-min``). The tokens actually attended to are measured
    (``TextResult.extra["avg_k"]``).
    kv: the K/V cache's dtype, the engine's ``--kv-cache-dtype`` ("auto": the model's; "fp8_e4m3" /
    "fp8_e5m2": stored as fp8 with scale 1.0, the engine's default without checkpoint scales, and
    prefilled through that cache: :mod:`.driver`). Any kind, dense too.
    """

    kind: str = "ds"
    channel_type: str = "qk"
    mode: str = "group_max"
    r: int = 16
    k_frac: float = 1 / 16
    num_sink: int = 0
    num_recent: int = 0
    dense_layers: int = 0
    label: str = "bf16"
    k_min: int = 0
    k_max: int = 0
    top_p: float = 0.0
    top_p_min: int = 0
    layer_modes: tuple[str, ...] = ()
    kv: str = "auto"

    def mode_of(self, layer: int) -> str:
        return self.layer_modes[layer] if self.layer_modes else self.mode

    @property
    def mode_name(self) -> str:
        return "layer_modes" if self.layer_modes else self.mode

    def __post_init__(self):
        if self.kind not in ("dense", "ds"):
            raise ValueError(f"kind must be 'dense' or 'ds', got {self.kind!r}")
        if self.kind == "ds" and not 0 < self.k_frac <= 1:
            raise ValueError(f"k_frac must be in (0, 1], got {self.k_frac}")
        if self.label not in LABEL_DTYPES:
            raise ValueError(f"label must be one of {LABEL_DTYPES}, got {self.label!r}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.kv not in KV_CACHE_DTYPES:
            raise ValueError(f"kv must be one of {KV_CACHE_DTYPES}, got {self.kv!r}")

    @property
    def kv_suffix(self) -> str:
        return "" if self.kv == "auto" else f"/kv:{self.kv}"

    @property
    def name(self) -> str:
        if self.kind == "dense":
            return "dense" + self.kv_suffix
        s = f"{self.channel_type}/{self.mode_name}/r{self.r}/k1:{round(1 / self.k_frac)}"
        if self.num_sink or self.num_recent:
            s += f"/s{self.num_sink}w{self.num_recent}"
        if self.dense_layers:
            s += f"/d{self.dense_layers}"
        if self.label != "bf16":
            s += f"/{self.label}"
        if self.k_min or self.k_max:
            s += f"/min{self.k_min}" + (f"max{self.k_max}" if self.k_max else "")
        if self.top_p:
            s += f"/p{self.top_p:g}min{self.top_p_min}"
        return s + self.kv_suffix

    @property
    def line(self) -> str:
        """Plot series: one line per (mode, type, extras); r and k vary along it."""
        if self.kind == "dense":
            return "dense" + (f"+kv:{self.kv}" if self.kv != "auto" else "")
        s = f"{self.mode_name}/{self.channel_type}"
        if self.num_sink or self.num_recent:
            s += f"+sink{self.num_sink}/recent{self.num_recent}"
        if self.dense_layers:
            s += f"+dense{self.dense_layers}"
        if self.label != "bf16":
            s += f"+{self.label}"
        if self.top_p:
            s += f"+top_p{self.top_p:g}"
        if self.kv != "auto":
            s += f"+kv:{self.kv}"
        return s

    def k_for(self, ctx: int) -> int:
        """Each request's k at context length ``ctx``."""
        k = max(1, self.k_min, round(self.k_frac * ctx))
        return min(k, self.k_max) if self.k_max else k

    def sink_recent(self, k: int) -> tuple[int, int]:
        """(sink, recent) actually forced at top-k ``k``: at most k/8 and k/4, the engine's
        scaling (``EngineConfig.sink_recent``), so the default setting is the engine's."""
        return min(self.num_sink, k // 8), min(self.num_recent, k // 4)

    def is_dense_layer(self, layer: int) -> bool:
        return self.kind == "dense" or layer < self.dense_layers

    def top_p_floor(self, k: int) -> int:
        """The top-p budget's lower bound at top-k ``k``."""
        return min(self.top_p_min, k)

    def bytes_per_step(self, ctx: int, num_layers: int, num_q_heads: int, num_kv_heads: int,
                       head_dim: int, k: float | None = None) -> int:
        """Bytes one decode step of one request reads at context length ``ctx`` (see module doc);
        ``k``: the tokens a row attends to, where measured (top-p), else the setting's k."""
        kvb = kv_bytes(self.kv)
        dense = ctx * num_kv_heads * head_dim * 2 * kvb
        if self.kind == "dense":
            return dense * num_layers
        k_set = min(self.k_for(ctx), ctx)
        k = k_set if k is None else k
        labels = ctx * num_kv_heads * self.r * LABEL_TORCH_DTYPES[self.label].itemsize
        total = 0
        for i in range(num_layers):
            rows = num_q_heads if self.mode_of(i) == "per_head" else num_kv_heads
            # ops.ds_decode falls back to dense when the context is short
            total += dense if i < self.dense_layers or k_set >= ctx else labels + k * rows * head_dim * 2 * kvb
        return round(total)


DENSE = Setting(kind="dense")
# plain group-sum selection at k = ctx/16: the baseline the improvements must beat
BASELINE = Setting("ds", "qk", "group_sum", 16, 1 / 16)


def default_setting(head_dim: int = 64, max_context: int | None = None,
                    layer_modes: tuple[str, ...] = (), device: str = "cpu", k_bias: bool = False,
                    point=None) -> Setting:
    """The engine's default Double Sparsity decode where it decodes sparsely: with ``point`` (an
    :class:`~doublesparse.engine.operating_point.OperatingPoint`, what the engine runs: the
    channel config's calibrated point, else the model's shape default) its r, budget (each
    request's k = its length x the ratio, clamped to [floor, max], the max from the model's
    ``max_context`` when given; the top-p budget where the point has one), selection and
    sink/recent tokens; without, ``EngineConfig``'s fallbacks (r = min(16, head_dim/4), 1/16 at
    least 512, 4 sink + 32 recent) and the modes ``layer_modes`` (the channel config's recorded
    per-layer modes; one mode when they agree; none: group_max). Channel type qk, and the label
    dtype the engine picks on ``device`` for a model with (``k_bias``) or without a K bias
    (``EngineConfig.label_dtype_for``: fp8 on recent NVIDIA GPUs, else bf16)."""
    from doublesparse.config import EngineConfig

    base = EngineConfig()
    cfg = point.fill(base) if point is not None else base
    sink, recent = cfg.sink_recent(1 << 20, point.sink_recent if point is not None else (4, 32))  # unscaled
    b = cfg.token_budget(max_context or (1 << 30))
    if point is not None:
        layer_modes = point.layer_modes
    modes = tuple(layer_modes)
    if point is not None and not modes:
        mode = point.selection
    else:
        mode = modes[0] if modes and len(set(modes)) == 1 else cfg.selection_mode_fallback
    return Setting("ds", cfg.ds_heavy_channel_type, mode, cfg.heavy_channel_num(head_dim),
                   b.ratio, num_sink=sink, num_recent=recent, k_min=b.k_min,
                   label=cfg.label_dtype_for(device, k_bias), k_max=b.k_max if max_context else 0,
                   top_p=b.top_p, top_p_min=b.k_min if b.top_p else 0,
                   layer_modes=modes if len(set(modes)) > 1 else ())


def with_kv(settings, kvs) -> list[Setting]:
    """``settings`` once per KV cache dtype in ``kvs`` (in that order), without repeats; with another
    cache than the model's, dense with the model's ("auto", every KL and top-1 reference) first
    when it is not there already."""
    out = [replace(s, kv=kv) for kv in kvs for s in settings]
    if DENSE not in out and any(s.kv != "auto" for s in out):
        out.insert(0, DENSE)
    return unique(out)


def unique(settings) -> list[Setting]:
    """``settings`` without repeats, first occurrence kept (a grid and the improvement variants
    overlap, e.g. qk/group_max/r16/k1:16 is in both)."""
    seen, out = set(), []
    for s in settings:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def grid(channel_types=("q", "k", "qk"), modes=("per_head", "group_sum", "group_max"),
         rs=(8, 16, 32), k_fracs=(1 / 32, 1 / 16, 1 / 8)) -> list[Setting]:
    return [Setting("ds", t, m, r, f) for t in channel_types for m in modes for r in rs for f in k_fracs]


def improvements(base: Setting, sink: int = 4, recent: int = 32, dense_layers: int = 2) -> list[Setting]:
    """Variants of ``base`` meant to beat plain group_sum at k = ctx/16."""
    return [
        replace(base, mode="group_max"),
        replace(base, num_sink=sink, num_recent=recent),
        replace(base, mode="group_max", num_sink=sink, num_recent=recent),
        replace(base, dense_layers=dense_layers),
        replace(base, mode="group_max", num_sink=sink, num_recent=recent, dense_layers=dense_layers),
    ]


def top_p_variants(base: Setting, ps=(0.9, 0.98), floor: int = 32) -> list[Setting]:
    """``base`` with the top-p budget at each mass in ``ps``: its k as each row's upper bound, at
    least ``base.k_min`` (the engine's lower bound) or else ``floor`` tokens."""
    return [replace(base, top_p=p, top_p_min=base.k_min or floor) for p in ps]


def preset(name: str) -> list[Setting]:
    """"small": a CPU/CI-sized set; "full": the GPU grid plus the improvement variants."""
    base = BASELINE
    if name == "small":
        out = [DENSE, base, Setting("ds", "k", "group_sum", 16, 1 / 16),
               Setting("ds", "qk", "per_head", 16, 1 / 16), Setting("ds", "qk", "group_sum", 8, 1 / 16),
               Setting("ds", "qk", "group_sum", 16, 1 / 8)]
        out += improvements(base)
        wide = Setting("ds", "qk", "group_max", 16, 1 / 8, num_sink=4, num_recent=32)
        out += [wide] + top_p_variants(wide)
    elif name == "full":
        out = [DENSE] + grid() + improvements(base)
        wide = Setting("ds", "qk", "group_max", 16, 1 / 8, num_sink=4, num_recent=32)
        out += [wide] + top_p_variants(wide, floor=128)
    else:
        raise ValueError(f"preset must be 'small' or 'full', got {name!r}")
    return unique(out)
