"""The eval's "default" setting carries the label dtype the engine picks on the eval's device, so
`doublesparse eval --default-only --device cuda` measures what the engine runs there."""

import pytest
import torch

from doublesparse.eval import protocol
from doublesparse.eval.cli import build_parser, settings_for
from doublesparse.eval.settings import DENSE, default_setting


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)


def test_default_setting_label_follows_the_device(hopper):
    cpu, gpu = default_setting(64), default_setting(64, device="cuda")
    assert cpu.label == "bf16" and gpu.label == "fp8"
    assert default_setting(64, device="cuda", k_bias=True) == cpu
    assert gpu.name == cpu.name.replace("/min", "/fp8/min") and gpu.name.endswith("/fp8/min512")
    args = build_parser().parse_args(["--default-only", "--device", "cuda"])
    assert settings_for(args, 64) == [DENSE, gpu]
    assert settings_for(args, 64, k_bias=True) == [DENSE, cpu]
    # --label-dtypes: the default once per dtype, in that order
    args = build_parser().parse_args(["--default-only", "--label-dtypes", "bf16", "fp8"])
    assert settings_for(args, 64) == [DENSE, cpu, gpu]


@pytest.mark.parametrize("device, first, other", [("cpu", "bf16", "fp8"), ("cuda", "fp8", "bf16")])
def test_protocol_label_pairs(hopper, device, first, other):
    args = protocol.build_parser().parse_args(["--device", device, "--label-dtypes", "bf16", "fp8"])
    a = protocol.plan_settings(args, 64)["a"]
    default = a[1]
    assert default.label == first and a[3].label == other and a[3].k_frac == default.k_frac
    assert [s.label for s in a[4:]] == [first, other] and a[4].k_frac == a[5].k_frac == 1 / 8
    assert len(set(a)) == len(a)
    only = protocol.plan_settings(protocol.build_parser().parse_args(["--device", device]), 64)["a"]
    assert only == a[:3]
