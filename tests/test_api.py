"""``doublesparse.Engine`` hands the engine what it asks of the layers above it (an on-demand
calibration, a starter of tensor-parallel ranks); the bare engine refuses the settings that need
one it was not given, in one line naming the setting."""

import json

import pytest

import doublesparse
from doublesparse import api, channels
from doublesparse.engine import engine as bare
from doublesparse.testing import ByteTokenizer, random_channel_config, tiny_llama

KW = dict(tokenizer=ByteTokenizer(), progress=False, max_total_tokens=1024, enable_double_sparsity=True,
          attention_backend="torch")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3, max_position_embeddings=256)


def test_the_python_api_engine_is_the_wired_one():
    assert doublesparse.Engine is api.Engine and issubclass(api.Engine, bare.Engine)


def test_auto_needs_an_injected_calibration(model):
    with pytest.raises(ValueError, match="--ds-channel-config-path auto") as err:
        bare.Engine(model=model, ds_channel_config_path="auto", **KW)
    assert "doublesparse.Engine" in str(err.value) and len(str(err.value).splitlines()) == 1


def test_the_injected_calibration_is_asked_for_the_config(model, tmp_path):
    path = channels.save_config(random_channel_config(model.config, ("per_head", "group_sum")),
                                tmp_path / "c.json")
    asked = []

    def calibrate(m, tok, model_file, progress=True):
        asked.append((m, tok, model_file, progress))
        return path

    e = bare.Engine(model=model, ds_channel_config_path="auto", calibrate=calibrate, **KW)
    assert len(asked) == 1 and asked[0][0] is model and asked[0][2] is None and asked[0][3] is False
    assert e.stats()["channels_calibrated"] and str(path) in e.stats()["channel_source"]
    assert json.loads(path.read_text())[channels.META_KEY]["model"] == model.config.name


def test_tensor_parallelism_needs_an_injected_starter(model):
    with pytest.raises(ValueError, match="tp_size 2") as err:
        bare.Engine(model=model, tp_size=2, **KW)
    assert "start_ranks" in str(err.value) and len(str(err.value).splitlines()) == 1

    class Started(Exception):
        pass

    def start_ranks(cfg, m, group):
        raise Started(cfg.tp_size, m, group)

    with pytest.raises(Started) as got:
        bare.Engine(model=model, tp_size=2, tp_group="the group", start_ranks=start_ranks, **KW)
    assert got.value.args == (2, model, "the group")


def test_the_wired_providers_reach_calibration_and_the_ranks(monkeypatch):
    from doublesparse.calibrate import on_demand
    from doublesparse.distributed import group
    monkeypatch.setattr(on_demand, "ensure_config", lambda *a, **k: ("calibrated", a, k))
    monkeypatch.setattr(group, "start", lambda *a: ("started", a))
    assert api.calibrate_on_demand("m", "t", None, progress=False) == ("calibrated", ("m", "t", None),
                                                                        {"progress": False})
    assert api.start_ranks("cfg", "m", "g") == ("started", ("cfg", "m", "g"))
