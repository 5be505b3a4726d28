"""The adaptive budget's controller on a synthetic model whose layers differ in difficulty: each
layer's sorted attention weights decay as exp(-i / tau), so a selection of k tokens captures
``1 - exp(-k / tau)`` of the mass (small tau: concentrated attention, an easy layer; large tau:
diffuse, a hard one), plus sampling noise. The loop must settle each layer where its recall meets
the target (or at a bound, on the right side of it), stay within the bounds, and not swing under
traffic that alternates between easy and hard text."""

import math
import random

import pytest

from doublesparse.attention.adaptive_control import AdaptiveConfig, BudgetController

K = 256  # the ratio budget's k at this length


def recall(tau: float, scale: float) -> float:
    return 1.0 - math.exp(-max(1, round(K * scale)) / tau)


def run(ctl, taus, samples, noise=0.01, seed=0, history=None):
    """Feed ``samples`` rounds of one sample per layer; taus(layer, i) gives the layer's tau of the
    i-th sample (the traffic)."""
    rng = random.Random(seed)
    for i in range(samples):
        for layer in range(ctl.num_layers):
            r = recall(taus(layer, i), ctl.scales[layer]) + rng.gauss(0.0, noise)
            ctl.add(layer, min(1.0, r))
        if history is not None:
            history.append(list(ctl.scales))


def test_converges_per_layer_difficulty():
    cfg = AdaptiveConfig(target=0.95)
    tau = [40.0, 100.0, 180.0, 400.0]  # easy, medium, hard, hopeless within 2x
    ctl = BudgetController(cfg, [2.0] * 4)
    hist = []
    run(ctl, lambda layer, i: tau[layer], 600, history=hist)
    s = ctl.scales
    assert s[0] < 1.0 and s[1] > 1.0 and s[2] > s[1]         # easy lowered, hard raised
    for layer, t in enumerate(tau):
        r = recall(t, s[layer])
        at_max, at_min = s[layer] == ctl.max_scales[layer], s[layer] == cfg.min_scale
        assert cfg.target - 0.01 <= r <= cfg.upper + 0.01 or (at_max and r < cfg.target) or (at_min and r > cfg.upper)
    assert s[3] == 2.0                                          # bounded, not runaway
    assert hist[-150:] == [s] * 150 or max(abs(a - b) for h in hist[-150:] for a, b in zip(h, s)) < 0.05 * max(s)


def test_stays_within_bounds_and_cost_caps():
    cfg = AdaptiveConfig(target=0.99, min_scale=0.5, max_scale=3.0)
    ctl = BudgetController(cfg, [1.5, 10.0, 0.8])             # layer 2's cost cap is below 1
    assert ctl.scales == [1.0, 1.0, 0.8]
    run(ctl, lambda layer, i: 1000.0, 300)                     # never enough: every scale rises
    assert ctl.scales == [1.5, 3.0, 0.8]
    run(ctl, lambda layer, i: 1.0, 300)                        # always plenty: every scale falls
    assert ctl.scales == [0.5, 0.5, 0.5]
    assert all(cfg.min_scale <= v <= m for v, m in zip(ctl.scales, ctl.max_scales))


@pytest.mark.parametrize("period", [1, 4, 8, 16, 24, 40])
def test_stable_under_alternating_traffic(period):
    """Easy and hard text alternate every ``period`` samples of a layer (8: exactly one decision
    window each): the scale settles between them, no swing in the second half."""
    cfg = AdaptiveConfig(target=0.95)
    ctl = BudgetController(cfg, [2.0])
    hist = []
    run(ctl, lambda layer, i: 60.0 if (i // period) % 2 else 140.0, 1600, history=hist, seed=period)
    late = [h[0] for h in hist[800:]]
    assert max(late) / min(late) <= 1.0 + 2 * cfg.min_step + 1e-9
    changes = sum(a != b for a, b in zip(late, late[1:]))
    assert changes <= 12
    # between the two texts' own settling points
    assert recall(140.0, late[-1]) < cfg.upper and recall(60.0, late[-1]) > cfg.target - 0.01


def test_window_and_reversals():
    cfg = AdaptiveConfig(target=0.9, window=4)
    ctl = BudgetController(cfg, [2.0])
    assert not any(ctl.add(0, 0.5) for _ in range(3))
    assert ctl.add(0, 0.5) and ctl.scales == [1.25]            # one decision per window, one step
    assert not ctl.add_mean(0, 0.99, 3)                        # the window restarts after a change
    assert ctl.add_mean(0, 0.5, 1) and ctl.scales == [1.25 * 1.25]   # mean 0.8675 < 0.9: up again
    assert ctl.add_mean(0, 0.99, 4) and ctl.reversals == [1]   # well above: down, a reversal
    assert ctl.steps == [0.125] and ctl.windows == [8]         # smaller steps, longer windows
    assert not ctl.add_mean(0, 0.5, 7) and ctl.add_mean(0, 0.5, 1)
    assert ctl.reversals == [2] and ctl.windows == [16]
    assert not ctl.add_mean(0, 0.93, 100)                      # in the dead band: holds
    assert ctl.summary()["changes"] == 4


def test_config_errors():
    with pytest.raises(ValueError, match="target"):
        AdaptiveConfig(target=1.0)
    with pytest.raises(ValueError, match="min_scale"):
        AdaptiveConfig(min_scale=2.0)
    with pytest.raises(ValueError, match="window"):
        AdaptiveConfig(window=0)


def test_follows_a_lasting_change_of_traffic():
    """After settling under alternating traffic, the traffic turns hard for good: the scale climbs
    to where the hard text meets the target."""
    cfg = AdaptiveConfig(target=0.95, max_scale=4.0)
    ctl = BudgetController(cfg, [4.0])
    run(ctl, lambda layer, i: 60.0 if (i // 8) % 2 else 140.0, 800)
    run(ctl, lambda layer, i: 200.0, 3000, seed=1)
    assert recall(200.0, ctl.scales[0]) >= cfg.target - 0.01
