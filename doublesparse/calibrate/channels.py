"""Calibration's side of channel configs: rankings from measured statistics.

The file format and its reader live with the engine (``doublesparse.engine.channel_config``); the
names are re-exported here for calibration scripts.
"""

from __future__ import annotations

from typing import Any

import torch

from ..engine.channel_config import (CHANNEL_TYPES, FORMAT_VERSION, META_KEY, MODES, group_ranking,
                                     layer_key, load_channels, mode_key, packaged_config_path,
                                     parse_channels, rank, rank_weights, read_config, recorded_modes,
                                     save_config)
from ..engine.weight_channels import default_channels


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


__all__ = ["CHANNEL_TYPES", "MODES", "META_KEY", "layer_key", "mode_key", "recorded_modes",
           "packaged_config_path", "rank",
           "rank_weights", "group_ranking", "stats_to_config", "save_config", "read_config",
           "parse_channels", "load_channels", "default_channels"]
