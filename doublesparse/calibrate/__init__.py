"""Offline calibration of heavy channels: statistics, the recall-measured selection modes and
operating point, on demand or from ``doublesparse calibrate``.

The channel-config format lives below the engine (:mod:`doublesparse.channels`); its main names
are handed on here: :func:`load_channels`, :func:`default_channels`, :func:`packaged_config_path`.
"""

from ..channels import (CHANNEL_TYPES, MODES, default_channels, load_channels, packaged_config_path,
                        parse_channels, save_config, stats_to_config)
from ..texts import CALIBRATION_PLAYS, EVAL_PLAYS

__all__ = ["CHANNEL_TYPES", "MODES", "default_channels", "load_channels", "packaged_config_path",
           "parse_channels", "save_config", "stats_to_config", "CALIBRATION_PLAYS", "EVAL_PLAYS"]
