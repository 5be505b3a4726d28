"""One calibration: channel statistics, then each selection mode's recall, into a config dict.

Shared by ``doublesparse calibrate`` and the engine's on-demand calibration
(``--ds-channel-config-path auto``), which must not import the CLI.
"""

from __future__ import annotations

import time
from typing import Any

from ..channels import META_KEY, MODES, mode_key, stats_to_config
from ..engine.operating_point import OP_KEY
from .recall import (
    CANDIDATES,
    POSITIONS_PER_WINDOW,
    REFERENCE_MODE,
    REFERENCE_RATIO,
    REL_MARGIN,
    KeepQK,
    choose_modes,
    decode_positions,
    kept_windows,
    measure_recall,
)
from .frontier import OpSettings, choose_point
from .stats import collect_stats, sample_windows, window_starts
from ..texts import encode, text_hash

STATISTIC = "mean over tokens of |q|, |k|, |q*k| per channel, post-RoPE (k repeated over its group)"
RECALL_SAMPLES = 4
RECALL = ("attention mass (dense softmax) on the tokens the mode selects at k = ceil(n/16) of the n "
          "tokens attended to, with the engine's default sink/recent tokens, qk channels, r = min(16, "
          "head_dim/4); mean over query heads and decode positions of the window's second half")


def build_config(model, tokenizer, texts: list[str], num_samples: int, seq_len: int, device="cpu",
                 progress: bool = True, cpu_threads: int = 0, recall_samples: int = RECALL_SAMPLES,
                 candidates=CANDIDATES, rel_margin: float = REL_MARGIN, meta: dict[str, Any] | None = None,
                 op: OpSettings | None = None) -> dict:
    """Calibrate ``model`` on ``num_samples`` windows of ``seq_len`` tokens of the concatenated
    texts and return the channel-config dict: rankings, per-layer ``ds_mode`` keys chosen from
    the measured recall (``recall_samples`` of the windows; 0: no modes recorded) and the meta
    (``meta`` entries added); with ``op``, then the operating point measured on held-apart
    windows of the same text (:mod:`.frontier`), its modes in the ``ds_mode`` keys (not for MLA
    models, whose bytes the candidates' cost does not describe)."""
    ids = _encode_all(tokenizer, texts)
    windows = sample_windows(ids, num_samples, seq_len)
    positions = decode_positions(seq_len)
    keeper = KeepQK(None, positions) if recall_samples > 0 else None
    keep = (keeper, kept_windows(len(windows), recall_samples)) if keeper else None
    t0 = time.perf_counter()
    stats = collect_stats(model, windows, device=device, progress=progress, cpu_threads=cpu_threads,
                          keep=keep)
    c = model.config
    info = {
        "model": getattr(c, "name", None),
        "num_layers": int(c.num_layers), "num_q_heads": int(c.num_q_heads),
        "num_kv_heads": int(c.num_kv_heads), "head_dim": int(c.head_dim),
        "statistic": STATISTIC,
        "group_aggregates": {"_kv": "sum over the KV head's query heads", "_kvmax": "max over them"},
        "text_sha256_16": text_hash(texts), "text_tokens": len(ids),
        "num_samples": num_samples, "seq_len": seq_len,
        "tokens_per_layer": int(stats["tokens"][0]),
    }
    info.update(meta or {})
    if keeper is not None:
        info["selection"] = _select(keeper, stats_to_config(stats, {}), c, positions, candidates, rel_margin)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    info["threads_per_sample"] = [int(n) for n in stats.get("threads", [])]
    cfg = stats_to_config(stats, info)
    meta = cfg.pop(META_KEY)
    for i, m in enumerate(info.get("selection", {}).get("per_layer", [])):
        cfg[mode_key(i)] = m
    cfg[META_KEY] = meta  # the meta stays the file's last key
    if op is not None and getattr(c, "mla", None) is None:
        cfg = add_point(cfg, model, ids, op, device, progress, cpu_threads)
    return cfg


def _encode_all(tokenizer, texts: list[str]) -> list[int]:
    ids: list[int] = []
    for t in texts:
        ids += encode(tokenizer, t)
    return ids


def add_point(cfg: dict, model, ids: list[int], op: OpSettings, device="cpu", progress: bool = True,
              cpu_threads: int = 0) -> dict:
    """``cfg`` (rankings calibrated on ``ids``, as its meta's ``num_samples`` x ``seq_len``
    windows) with the operating point measured on held-apart windows of ``ids`` and its
    selection written into the ``ds_mode`` keys; a new dict, keys in file order."""
    meta = cfg[META_KEY]
    n, sl = int(meta["num_samples"]), int(meta["seq_len"])
    used = [(s, s + sl) for s in window_starts(len(ids), n, sl)]
    L = int(model.config.num_layers)
    recall = (meta.get("selection") or {}).get("per_layer")
    rec = choose_point(model, ids, used, cfg, tuple(recall) if recall else None, op, device, progress,
                       cpu_threads)
    chosen = rec["chosen"]
    # a per-layer point runs the recall's per-layer modes (the only per-layer candidate)
    modes = list(recall) if chosen["ds_selection_mode"] == "per_layer" else [chosen["ds_selection_mode"]] * L
    out = {k: v for k, v in cfg.items() if k not in (META_KEY, OP_KEY) and not k.endswith(".ds_mode")}
    for i, m in enumerate(modes):
        out[mode_key(i)] = m
    out[OP_KEY] = rec
    out[META_KEY] = meta
    return out


def point_for_config(cfg: dict, model, tokenizer, texts: list[str], op: OpSettings, device="cpu",
                     progress: bool = True, cpu_threads: int = 0) -> dict:
    """An existing config (its rankings and recall unchanged) with the operating point measured
    anew: ``doublesparse calibrate --from-config``. ``texts`` must be the ones it was calibrated
    on for the held-apart windows to miss its statistics' windows (checked by hash)."""
    if getattr(model.config, "mla", None) is not None:
        raise ValueError("the operating point is not measured for MLA models (their decode bytes are "
                         "one latent row per token); the engine runs its MLA default")
    meta = cfg.get(META_KEY) or {}
    for k in ("num_samples", "seq_len"):
        if k not in meta:
            raise ValueError(f"channel config lacks {META_KEY}[{k!r}]: it was not written by "
                             f"`doublesparse calibrate`; calibrate the model instead")
    if meta.get("text_sha256_16") and meta["text_sha256_16"] != text_hash(texts):
        raise ValueError(f"the channel config was calibrated on other text ({META_KEY}.text_sha256_16 "
                         f"{meta['text_sha256_16']}, these texts {text_hash(texts)}): pass the same --text")
    return add_point(cfg, model, _encode_all(tokenizer, texts), op, device, progress, cpu_threads)


def _select(keeper: KeepQK, cfg: dict, model_config, positions, candidates, rel_margin: float) -> dict:
    """Recall of every mode with the calibrated channels, and the chosen mode per layer."""
    measured = measure_recall(keeper.windows, cfg, model_config, positions, modes=MODES)
    choice = choose_modes(measured["recall"], candidates, rel_margin=rel_margin)
    rec = measured["recall"]
    chosen = [rec[m][i] for i, m in enumerate(choice["per_layer"])]
    return {"recall_definition": RECALL, "reference_ratio": REFERENCE_RATIO,
            "recall_samples": len(keeper.windows), "positions_per_window": len(positions),
            "candidates": list(candidates), "reference_mode": REFERENCE_MODE,
            "rel_margin": rel_margin, "model_mode": choice["model_mode"],
            "per_layer": choice["per_layer"],
            "recall_mean": {m: round(sum(v) / len(v), 5) for m, v in rec.items()},
            "recall_chosen_mean": round(sum(chosen) / len(chosen), 5),
            "oracle_mean": round(sum(measured["oracle"]) / len(measured["oracle"]), 5),
            "recall": {m: [round(x, 5) for x in v] for m, v in rec.items()},
            "oracle": [round(x, 5) for x in measured["oracle"]]}


__all__ = ["POSITIONS_PER_WINDOW", "RECALL_SAMPLES", "STATISTIC", "build_config", "add_point",
           "point_for_config"]
