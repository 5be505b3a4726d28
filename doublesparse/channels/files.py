"""Channel config files: which head channels go into the label cache (the format, its reader and
writer, and the shipped configs under ``doublesparse/configs/channels/``).

File format (JSON, readable by SGLang and the DoubleSparse repo, which only look up the keys they know):

    "model.layers.{i}.self_attn.q_proj"     : [Hq][D]   channel indices, most important first
    "model.layers.{i}.self_attn.k_proj"     : [Hkv][D]
    "model.layers.{i}.self_attn.qk_proj"    : [Hq][D]
    "model.layers.{i}.self_attn.q_proj_kv"  : [Hkv][D]  ours only: ranking of the group aggregate
    "model.layers.{i}.self_attn.qk_proj_kv" : [Hkv][D]    sum over the KV head's query heads
    "model.layers.{i}.self_attn.q_proj_kvmax", "..qk_proj_kvmax" : [Hkv][D]  ours only: max over group
    "model.layers.{i}.self_attn.ds_mode"    : "group_max" | "group_sum" | "per_head"  ours only:
                                              the layer's selection mode, chosen by calibration
    "doublesparse_meta"                     : {model, layers, heads, ...}  ignored by other readers

The label cache holds one channel set per KV head (``[L, Hkv, r]``), while q/qk rankings are per
query head. :func:`load_channels` maps them onto KV heads (see :func:`group_ranking`), which is
where SGLang crashed on GQA models. Calibration (``doublesparse.calibrate``) measures the
statistics that :func:`stats_to_config` turns into a file; the engine, calibration and evaluation
all read and write files here, below each of them.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

CHANNEL_TYPES = ("q", "k", "qk")
MODES = ("per_head", "group_sum", "group_max")
META_KEY = "doublesparse_meta"
FORMAT_VERSION = 1
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "channels"

# shipped configs: (words that must all appear in the model name) -> file under configs/channels/.
# Names vary by source: "SmolLM2-135M-Instruct" (HF), "Smollm2 135M 8k Lc100K Mix1 Ep2" (the GGUF's
# general.name), a file path; so we match words, not strings. A dot between digits stays inside
# its word, so "1.5b" never matches the "5b" of "0.5b" (see :func:`name_words`).
PACKAGED = {
    ("smollm2", "135m"): "smollm2-135m-instruct.json",
    ("qwen2.5", "coder", "1.5b", "instruct"): "qwen2.5-coder-1.5b-instruct.json",
}
# word separators: anything but letters and digits, and a dot unless it sits between two digits
_WORD_SEP = re.compile(r"(?:[^a-z0-9.]|(?<![0-9])\.|\.(?![0-9]))+")


def layer_key(layer: int, channel_type: str, suffix: str = "") -> str:
    if channel_type not in CHANNEL_TYPES:
        raise ValueError(f"channel_type must be one of {CHANNEL_TYPES}, got {channel_type!r}")
    return f"model.layers.{layer}.self_attn.{channel_type}_proj{suffix}"


def mode_key(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.ds_mode"


def recorded_modes(cfg: dict, num_layers: int) -> tuple[str, ...] | None:
    """The per-layer selection modes a config records (``ds_mode`` keys), or None when it records
    none (SGLang / DoubleSparse files, ours before calibration chose modes). A config that records
    some layers but not all, or an unknown mode, is refused: the engine would otherwise mix a
    measured choice with a guess."""
    have = [mode_key(i) in cfg for i in range(num_layers)]
    if not any(have):
        return None
    if not all(have):
        missing = [i for i, h in enumerate(have) if not h]
        raise ValueError(f"channel config records ds_mode for some layers but not for {missing[:8]}")
    modes = tuple(cfg[mode_key(i)] for i in range(num_layers))
    bad = sorted({m for m in modes if m not in MODES}, key=str)
    if bad:
        raise ValueError(f"channel config: ds_mode must be one of {MODES}, got {bad}")
    return modes


def name_words(model_name: str) -> set[str]:
    """The lower-case words of a model name or of a path's last part: "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"
    -> {"qwen2.5", "coder", "1.5b", "instruct", "q4", "k", "m", "gguf"}."""
    name = str(model_name).replace("\\", "/").rstrip("/").split("/")[-1].lower()
    return {w for w in _WORD_SEP.split(name) if w}


def packaged_config_path(model_name: str | None) -> Path | None:
    """The shipped calibrated config for a model name or path (case-insensitive), or None."""
    if not model_name:
        return None
    words = name_words(model_name)
    for need, fname in PACKAGED.items():
        if all(w in words for w in need):
            p = CONFIG_DIR / fname
            return p if p.is_file() else None
    return None


# ----------------------------------------------------------------------------------------- ranking
def rank(stat: torch.Tensor) -> torch.Tensor:
    """Channel indices sorted by decreasing statistic: ``[..., D]`` -> ``[..., D]`` long.

    Stable sort so that ties (e.g. both channels of a RoPE pair) keep index order, which makes the
    files reproducible across runs and machines.
    """
    return torch.sort(stat.double(), dim=-1, descending=True, stable=True).indices


def rank_weights(ranking: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Importance implied by a ranking alone: ``[H, n]`` indices -> ``[H, head_dim]`` weights.

    Channel at rank j gets ``head_dim - j`` (Borda count); channels a truncated ranking leaves out
    get 0. Used when a file carries rankings but no magnitudes (SGLang / DoubleSparse configs).
    """
    H, n = ranking.shape
    w = torch.zeros(H, head_dim, dtype=torch.float64)
    vals = torch.arange(head_dim, head_dim - n, -1, dtype=torch.float64).expand(H, n)
    w.scatter_(1, ranking.long(), vals)
    return w


def group_ranking(per_q_head: torch.Tensor, num_kv_heads: int, head_dim: int, mode: str) -> torch.Tensor:
    """Map a per-query-head ranking ``[Hq, n]`` onto KV heads: ``[Hkv, head_dim]`` ranking.

    Rule: each query head's ranking is turned into Borda weights (:func:`rank_weights`); the
    group's weights are summed for "per_head" and "group_sum" (every head of the group reads the
    same labels, so a channel's worth is its total use), and maxed for "group_max" (a channel that
    is at the top for one head survives, matching the max-over-heads token score), with the sum
    breaking ties.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    hq = per_q_head.shape[0]
    g = hq // num_kv_heads
    w = rank_weights(per_q_head, head_dim).view(num_kv_heads, g, head_dim)
    total = w.sum(1)
    if mode == "group_max":
        # max dominates; the sum / (g * D + 1) < 1 only separates equal maxima
        score = w.amax(1) + total / (g * head_dim + 1)
    else:
        score = total
    return rank(score)


# ------------------------------------------------------------------------------------------ saving
def stats_to_config(stats: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """Build the JSON dict from calibration statistics.

    stats: "q" [L, Hq, D], "k" [L, Hkv, D], "qk" [L, Hq, D] (mean |.| per channel), and optionally
    "qk_kv", "q_kv" [L, Hkv, D] (sum over the group) and "qk_kvmax", "q_kvmax" [L, Hkv, D] (max).
    """
    cfg: dict[str, Any] = {}
    L = stats["k"].shape[0]
    for i in range(L):
        for t in CHANNEL_TYPES:
            cfg[layer_key(i, t)] = rank(stats[t][i]).tolist()
        for t in ("q", "qk"):
            for suffix in ("_kv", "_kvmax"):
                if t + suffix in stats:
                    cfg[layer_key(i, t, suffix)] = rank(stats[t + suffix][i]).tolist()
    cfg[META_KEY] = dict(meta, format_version=FORMAT_VERSION)
    return cfg


def save_config(cfg: dict[str, Any], path: str | Path) -> Path:
    """Write one key per line: diffable, and still plain JSON for the other readers."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"  {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in cfg.items()]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------------- loading
def _get(model_config, *names):
    for n in names:
        if hasattr(model_config, n):
            return int(getattr(model_config, n))
    raise AttributeError(f"model config lacks {names[0]}")


def _check_rows(cfg: dict, key: str, rows: int, head_dim: int, need: int) -> torch.Tensor:
    """Validate ``cfg[key]`` as ``[rows][n]`` distinct indices in [0, head_dim) with n >= need."""
    shape = f"[{rows}][{head_dim}]"
    if key not in cfg:
        raise ValueError(f"channel config lacks key {key!r} (expected a {shape} list of channel indices)")
    val = cfg[key]
    if not isinstance(val, list) or len(val) != rows or not all(isinstance(r, list) for r in val):
        got = len(val) if isinstance(val, list) else type(val).__name__
        raise ValueError(f"{key!r}: expected shape {shape} (one row per head), got {got} rows")
    lens = {len(r) for r in val}
    if len(lens) != 1:
        raise ValueError(f"{key!r}: expected shape {shape}, rows have different lengths {sorted(lens)}")
    n = lens.pop()
    if n > head_dim or n < need:
        raise ValueError(f"{key!r}: expected shape {shape} (at least {need} channels per row), "
                         f"got rows of {n}")
    try:
        t = torch.tensor(val, dtype=torch.long)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{key!r}: expected shape {shape} of integer channel indices ({e})") from None
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= head_dim):
        raise ValueError(f"{key!r}: channel index out of range [0, {head_dim}) in a {shape} list")
    srt = t.sort(dim=1).values
    if n > 1 and bool((srt[:, 1:] == srt[:, :-1]).any()):
        h = int((srt[:, 1:] == srt[:, :-1]).any(1).nonzero()[0])
        raise ValueError(f"{key!r}: row {h} repeats a channel index (expected shape {shape}, distinct)")
    return t


def _count_layers(cfg: dict) -> int:
    idx = set()
    for k in cfg:
        if k.startswith("model.layers.") and ".self_attn." in k:
            try:
                idx.add(int(k.split(".")[2]))
            except ValueError:
                continue
    return max(idx) + 1 if idx else 0


def parse_channels(cfg: dict, model_config, channel_type: str, heavy_channel_num: int,
                   mode: str | Sequence[str] = "group_max") -> torch.Tensor:
    """As :func:`load_channels`, from an already-parsed JSON dict. ``mode``: one selection mode
    for every layer, or one per layer (the ranking of a layer's KV head follows its mode)."""
    if channel_type not in CHANNEL_TYPES:
        raise ValueError(f"channel_type must be one of {CHANNEL_TYPES}, got {channel_type!r}")
    L = _get(model_config, "num_layers", "num_hidden_layers")
    modes = (mode,) * L if isinstance(mode, str) else tuple(mode)
    # the layer mode sums every head's scores: its KV heads' channels are ranked as group_sum's
    modes = tuple("group_sum" if m == "layer" else m for m in modes)
    if len(modes) != L:
        raise ValueError(f"got {len(modes)} selection modes for a model of {L} layers")
    for m in set(modes):
        if m not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {m!r}")
    hq = _get(model_config, "num_q_heads", "num_attention_heads")
    hkv = _get(model_config, "num_kv_heads", "num_key_value_heads")
    D = _get(model_config, "head_dim")
    r = int(heavy_channel_num)
    if not 0 < r <= D:
        raise ValueError(f"heavy_channel_num must be in [1, {D}] (head_dim), got {heavy_channel_num}")
    if hq % hkv:
        raise ValueError(f"num_q_heads={hq} is not a multiple of num_kv_heads={hkv}")
    if not isinstance(cfg, dict):
        raise ValueError("channel config must be a JSON object of 'model.layers.{i}.self_attn.*' keys")
    found = _count_layers(cfg)
    if found != L:
        raise ValueError(f"channel config has {found} layers (keys 'model.layers.{{i}}.self_attn.*'), "
                         f"the model has {L}: expected keys model.layers.0..{L - 1}")
    meta = cfg.get(META_KEY) or {}
    for field, want in (("num_q_heads", hq), ("num_kv_heads", hkv), ("head_dim", D)):
        if field in meta and int(meta[field]) != want:
            raise ValueError(f"{META_KEY!r}: {field}={meta[field]} but the model has {want}")
    out = torch.empty(L, hkv, r, dtype=torch.long)
    for i in range(L):
        if channel_type == "k":
            ranking = _check_rows(cfg, layer_key(i, "k"), hkv, D, r)
        else:
            key = layer_key(i, channel_type)
            per_q = _check_rows(cfg, key, hq, D, r)
            # Our files carry the group aggregate computed from magnitudes: better than rank votes.
            agg = layer_key(i, channel_type, "_kvmax" if modes[i] == "group_max" else "_kv")
            if agg in cfg:
                ranking = _check_rows(cfg, agg, hkv, D, r)
            elif hq == hkv:
                ranking = per_q
            else:
                ranking = group_ranking(per_q, hkv, D, modes[i])
        out[i] = ranking[:, :r]
    return out


def read_config(path: str | Path) -> dict:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON channel config ({e})") from None


def load_channels(path: str | Path, model_config, channel_type: str = "qk", heavy_channel_num: int = 16,
                  mode: str | Sequence[str] = "group_max") -> torch.Tensor:
    """Heavy channels for the label cache: LongTensor ``[num_layers, Hkv, heavy_channel_num]``.

    Accepts our files and SGLang / DoubleSparse ones (q_proj/qk_proj with Hq rows, k_proj with Hkv
    rows). Raises ValueError naming the key and expected shape when the file does not fit the model.
    """
    cfg = read_config(path)
    meta = cfg.get(META_KEY) or {}
    name = getattr(model_config, "name", None)
    if meta.get("model") and name and str(meta["model"]).lower() != str(name).lower():
        warnings.warn(f"channel config {path} was calibrated on {meta['model']!r}, loading it for {name!r}")
    return parse_channels(cfg, model_config, channel_type, heavy_channel_num, mode)


__all__ = ["CHANNEL_TYPES", "MODES", "META_KEY", "FORMAT_VERSION", "layer_key", "mode_key",
           "recorded_modes", "name_words", "packaged_config_path",
           "rank", "rank_weights", "group_ranking", "stats_to_config", "save_config", "read_config",
           "parse_channels", "load_channels"]
