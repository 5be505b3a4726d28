"""Shipped channel configs: which model names find them, and that each fits its model's shape."""

from dataclasses import dataclass

import pytest

from doublesparse.config import EngineConfig
from doublesparse import channels as ch
from doublesparse.engine.ds_setup import resolve_channels


@dataclass(frozen=True)
class Shape:
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    name: str


QWEN_CODER_15B = Shape(28, 12, 2, 128, "Qwen2.5 Coder 1.5B Instruct GGUF")   # the GGUF's general.name
QWEN_FILE = "qwen2.5-coder-1.5b-instruct.json"


@pytest.mark.parametrize("name", [
    QWEN_CODER_15B.name,
    "Qwen/Qwen2.5-Coder-1.5B-Instruct",
    "/models/qwen2.5-coder-1.5b/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
    "C:\\models\\Qwen2.5-Coder-1.5B-Instruct\\",
])
def test_qwen_coder_15b_names_find_its_config(name):
    p = ch.packaged_config_path(name)
    assert p is not None and p.name == QWEN_FILE


@pytest.mark.parametrize("name", [
    "Qwen2.5 Coder 0.5B Instruct",        # "5b" of "0.5b" must not pass for "1.5b"
    "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    "Qwen2.5-Coder-15B-Instruct",
    "Qwen2.5-1.5B-Instruct",              # not the coder model
    "Qwen2.5-Coder-1.5B",                 # base weights: the config was calibrated on the instruct ones
    "Qwen2-Coder-1.5B-Instruct",
])
def test_other_qwen_names_do_not(name):
    assert ch.packaged_config_path(name) is None


def test_name_words_keep_decimal_sizes():
    assert ch.name_words("Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf") == {
        "qwen2.5", "coder", "1.5b", "instruct", "q4", "k", "m", "gguf"}
    assert {"smollm2", "135m"} <= ch.name_words("Smollm2 135M 8k Lc100K Mix1 Ep2")


def test_qwen_coder_15b_config_fits_the_model():
    p = ch.packaged_config_path(QWEN_CODER_15B.name)
    cfg = ch.read_config(p)
    meta = cfg[ch.META_KEY]
    assert (meta["num_layers"], meta["num_q_heads"], meta["num_kv_heads"], meta["head_dim"]) == (28, 12, 2, 128)
    assert meta["model"] == QWEN_CODER_15B.name
    modes = ch.recorded_modes(cfg, 28)
    assert modes is not None and list(modes) == meta["selection"]["per_layer"]
    for t in ch.CHANNEL_TYPES:
        assert tuple(ch.load_channels(p, QWEN_CODER_15B, t, 32, modes).shape) == (28, 2, 32)
    # the engine picks it (with the recorded per-layer modes) when no config path is given
    choice = resolve_channels(EngineConfig(), None, QWEN_CODER_15B, 16)
    assert choice.calibrated and choice.modes == modes and QWEN_FILE in choice.source
    assert tuple(choice.channels.shape) == (28, 2, 16)


@pytest.mark.parametrize("name,shape", [
    (QWEN_CODER_15B.name, QWEN_CODER_15B),
    ("Smollm2 135M 8k Lc100K Mix1 Ep2", Shape(30, 9, 3, 64, "Smollm2 135M 8k Lc100K Mix1 Ep2")),
])
def test_packaged_configs_carry_a_measured_point(name, shape):
    from doublesparse.engine import operating_point as op
    from doublesparse.engine.ds_setup import resolve_point
    cfg = ch.read_config(ch.packaged_config_path(name))
    rec = cfg[op.OP_KEY]
    assert rec["target_met"] and rec["chosen"]["kl"] <= rec["kl_target"] and rec["frontier"]
    point = resolve_point(shape, ch.packaged_config_path(name))
    assert point.source == "calibrated" and point.heavy_channel_num == rec["chosen"]["ds_heavy_channel_num"]
    assert point.modes(shape.num_layers) == ch.recorded_modes(cfg, shape.num_layers)
