"""Heavy channels: which head channels go into the label cache, and where they come from.

:mod:`.files` (channel config files: the format, reading, validating and writing them, and the
configs shipped for known models) and :mod:`.weights` (the weight-based default when no config is
given). The engine, calibration, evaluation and the tests all read channels here.
"""

from .files import (CHANNEL_TYPES, CONFIG_DIR, FORMAT_VERSION, META_KEY, MODES, PACKAGED, group_ranking,
                    layer_key, load_channels, mode_key, name_words, packaged_config_path, parse_channels, rank,
                    rank_weights, read_config, recorded_modes, save_config, stats_to_config)
from .weights import default_channels, find_attention_weights, rope_pairs

__all__ = ["CHANNEL_TYPES", "CONFIG_DIR", "FORMAT_VERSION", "META_KEY", "MODES", "PACKAGED", "group_ranking",
           "layer_key", "load_channels", "mode_key", "name_words", "packaged_config_path", "parse_channels",
           "rank", "rank_weights", "read_config", "recorded_modes", "save_config", "stats_to_config",
           "default_channels", "find_attention_weights", "rope_pairs"]
