"""The adaptive budget in the engine (tiny random Llama on CPU): at scale 1 it generates the ratio
budget's tokens; each layer attends to its scaled k within the clamps; the loop moves the scales
from the sampled recall and reports them; flags and refusals."""

import pytest
import torch

from doublesparse.attention.adaptive_control import AdaptiveConfig, BudgetController
from doublesparse.attention.budget import DENSE
from doublesparse.engine import Engine
from doublesparse.testing import ByteTokenizer, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")
SP = dict(temperature=0.0, ignore_eos=True, max_new_tokens=12)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, max_position_embeddings=512)


def engine(model, **kw):
    return Engine(model=model, tokenizer=ByteTokenizer(), progress=False, max_total_tokens=2048,
                  enable_double_sparsity=True, ds_heavy_token_ratio=0.25, ds_heavy_token_min=4,
                  ds_sparse_decode_threshold=0, max_running_requests=4, ds_recall_sample_interval=1, **kw)


def prompts():
    return [list(range(1, 40)), list(range(3, 60, 2)), [7] * 25]


def frozen(e, scales=None):
    """Hold the scales (no decision ever) at ``scales`` (default 1)."""
    a = e.parts.adaptive
    a.ctl = BudgetController(AdaptiveConfig(window=1 << 30), [a.ctl.cfg.max_scale] * a.ctl.num_layers)
    a.ctl.scales = [1.0] * a.ctl.num_layers if scales is None else list(scales)
    a._push()
    return a


def test_scale_one_generates_the_ratio_tokens(model):
    ref = engine(model).generate(prompts(), SP)
    e = engine(model, ds_budget_mode="adaptive")
    frozen(e)
    got = e.generate(prompts(), SP)
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in ref]
    # the workspace's k holds the largest scale; the plan's k is the ratio budget's
    assert e.parts.ds.k_max == 2 * engine(model).parts.ds.k_max


def test_each_layer_attends_to_its_scaled_k(model):
    e = engine(model, ds_budget_mode="adaptive")
    a = frozen(e, [0.5, 2.0])
    b = e.parts.backend
    seen = []
    inner = b._decode

    def spy(layer_id, q, q_label, req_idx, seq_lens, ws, args, out=None):
        seen.append((layer_id, args.k.tolist(), seq_lens.tolist()))
        return inner(layer_id, q, q_label, req_idx, seq_lens, ws, args, out)

    b._decode = spy
    e.generate(prompts(), dict(SP, max_new_tokens=4))
    assert seen
    for layer, ks, lens in seen:
        for k, n in zip(ks, lens):
            planned = max(4, -(-n // 4))  # ceil(n / 4), at least k_min
            want = min(a.k_max, max(a.k_lo, round(planned * (0.5, 2.0)[layer])))
            assert k == want, (layer, n, k, want)


def test_layer_ks_matches_the_host_and_keeps_dense_rows():
    class B:  # the few backend fields AdaptiveBudget reads
        class ds:
            k_max, num_sink, num_recent = 100, 0, 0

            class policy:
                class budget:
                    k_min = 8

        class memory:
            label = [torch.zeros(1)]

    class P:
        sampled_steps, pending, scale_k = 0, 0, None

    from doublesparse.attention.adaptive import AdaptiveBudget
    a = AdaptiveBudget(AdaptiveConfig(max_scale=4.0), B, P, [4.0, 4.0, 4.0])
    a.ctl.scales = [0.37, 1.0, 3.3]
    a._push()
    ks = torch.tensor([DENSE, 5, 8, 9, 33, 50, 99], dtype=torch.int32)
    got = a.layer_ks(ks)
    assert got.shape == (3, 7) and got.dtype == torch.int32
    assert (got[:, 0] == DENSE).all()
    # clamps: k_max above; below, the floor (8) times the smallest scale (0.25), not the floor
    assert a.k_lo == 2 and int(got[1, 4]) == 33 and int(got[2, 6]) == 100 and int(got[0, 1]) == 2
    assert int(got[0, 3]) == 3  # round(9 x 0.37): under the ratio budget's floor
    for layer in range(3):
        assert got[layer, 1:].tolist() == a.host_ks(layer, ks[1:].tolist())


def test_loop_moves_scales_within_bounds_and_reports(model):
    e = engine(model, ds_budget_mode="adaptive", ds_target_recall=0.9)
    e.generate(prompts() * 2, dict(SP, max_new_tokens=24))
    st = e.stats()["budget_scale"]
    a = e.parts.adaptive
    # random weights attend diffusely: recall falls short, the scales rise, within their bounds
    assert st["target_recall"] == 0.9 and st["changes"] >= 1
    assert all(1.0 < s <= m for s, m in zip(st["scales"], st["max_scales"]))
    assert st["groups"] and st["k_min"] == 4 and st["k_max"] == e.parts.ds.k_max
    assert a.scale.tolist() == pytest.approx(st["scales"])   # the device holds what the host decided
    assert a.pushes >= 1
    # the bytes the step reads follow the scales (more than the ratio budget's at scale > 1)
    ratio = engine(model)
    lens = [200, 300]
    assert e.parts.backend.decode_bytes(lens) > ratio.parts.backend.decode_bytes(lens)
    frozen(e)
    assert e.parts.backend.decode_bytes(lens) == ratio.parts.backend.decode_bytes(lens)


def test_flags_and_refusals():
    import argparse

    from doublesparse.config import EngineConfig
    from doublesparse.config_flags import add_cli_args, from_cli_args
    ns = add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--ds-budget-mode", "adaptive", "--ds-target-recall", "0.9"])
    cfg = from_cli_args(ns)
    assert cfg.budget_mode == "adaptive" and cfg.adaptive_config.target == 0.9
    assert EngineConfig(ds_budget_mode="adaptive").adaptive_config.target == 0.95
    b = EngineConfig(ds_budget_mode="adaptive", ds_heavy_token_ratio=0.1).token_budget(1000)
    assert (b.k_max, b.ratio, b.top_p) == (200, 0.1, 0.0)
    assert EngineConfig(ds_budget_mode="adaptive", ds_heavy_token_ratio=0.8).token_budget(1000).k_max == 1000
    for kw, field in ((dict(ds_target_recall=0.9), "ds_target_recall"),
                      (dict(ds_budget_mode="adaptive", ds_target_recall=1.0), "ds_target_recall"),
                      (dict(ds_budget_mode="adaptive", ds_heavy_token_num=64), "ds_heavy_token_num"),
                      (dict(ds_budget_mode="adaptive", ds_recall_sample_interval=0), "ds_recall_sample_interval"),
                      (dict(ds_budget_mode="adaptive", enable_ds_offload=True), "enable_ds_offload")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**kw)
