"""Per-request token budgets and the dense/sparse choice of a decode step (attention/budget.py),
and their wiring: config -> engine -> runner -> the kernels' per-request k."""

import math

import pytest

from doublesparse.attention.budget import DENSE, DecodeCost, DecodePolicy, TokenBudget
from doublesparse.config import EngineConfig
from doublesparse.config_flags import add_cli_args, from_cli_args

# Llama-3.1-8B-like costs per token (all 32 layers): K+V 128 KiB, r=16 bf16 labels 8 KiB, selected
# rows the same as K+V; an H200-like bandwidth and 32 x 15 us of fixed sparse time per step.
LLAMA = DecodeCost(131072, 8192, 131072, 4.24e12, 32 * 15e-6)


def test_budget_ratio_clamps_and_fixed():
    b = TokenBudget(512, 8192, 1 / 16)
    assert [b.k_for(n) for n in (100, 8192, 8193, 16000, 60000, 10**6)] == [512, 512, 513, 1000, 3750, 8192]
    assert TokenBudget.fixed(300).k_for(10**6) == 300 == TokenBudget.fixed(300).k_for(5)
    for bad in (dict(k_min=0, k_max=4), dict(k_min=8, k_max=4), dict(k_min=1, k_max=4, ratio=1.5)):
        with pytest.raises(ValueError):
            TokenBudget(**bad)


def test_config_budget_defaults_and_flags():
    assert EngineConfig().token_budget(131072) == TokenBudget(512, 8192, 1 / 16)
    assert EngineConfig().token_budget(4096) == TokenBudget(256, 256, 1 / 16)  # short model: one k
    assert EngineConfig(ds_heavy_token_num=1000).token_budget(131072) == TokenBudget.fixed(1000)
    p = add_cli_args(__import__("argparse").ArgumentParser())
    c = from_cli_args(p.parse_args(["--ds-heavy-token-ratio", "0.125", "--ds-heavy-token-min", "64",
                                    "--ds-heavy-token-max", "4096", "--ds-sparse-decode-threshold", "auto"]))
    assert c.token_budget(131072) == TokenBudget(64, 4096, 0.125) and c.ds_sparse_decode_threshold is None
    assert from_cli_args(p.parse_args(["--ds-sparse-decode-threshold", "5000"])).ds_sparse_decode_threshold == 5000
    with pytest.raises(SystemExit):
        p.parse_args(["--ds-sparse-decode-threshold", "sometimes"])
    with pytest.raises(ValueError, match="ratio"):
        EngineConfig(ds_heavy_token_ratio=0)


def test_threshold_keeps_sglang_meaning():
    pol = DecodePolicy(TokenBudget.fixed(100), threshold=1000)
    assert pol.plan([50, 500, 1000, 5000]) == ([DENSE, DENSE, 100, 100], True)
    assert pol.plan([50, 999]) == ([DENSE, DENSE], False)
    assert DecodePolicy(TokenBudget.fixed(100), threshold=0).plan([100, 101]) == ([DENSE, 100], True)


def test_auto_choice_follows_the_bytes():
    pol = DecodePolicy(TokenBudget(512, 8192, 1 / 16), None, LLAMA)
    # one short request: the bytes it saves take less time than the sparse launches add
    assert pol.plan([4096]) == ([DENSE], False) and pol.plan([16384]) == ([DENSE], False)
    # long or many: sparse; each request keeps its own k
    ks, sparse = pol.plan([120000])
    assert sparse and ks == [7500]
    ks, sparse = pol.plan([16384] * 32)
    assert sparse and ks == [1024] * 32
    # a short request in a sparse step still decodes densely (it would read more)
    ks, sparse = pol.plan([60000, 60000, 300])
    assert sparse and ks == [3750, 3750, DENSE]
    # the decision's boundary is where the saved bytes equal the fixed time
    n = next(n for n in range(1000, 200000, 100) if pol.plan([n])[1])
    assert LLAMA.saving_s(n, math.ceil(n / 16)) > LLAMA.sparse_step_overhead_s >= LLAMA.saving_s(n - 100, math.ceil((n - 100) / 16))


def test_engine_plans_per_request_k(monkeypatch):
    """The engine's runner hands each request's own k to the backend, and counts sparse steps per
    request from the same plan."""
    from doublesparse.engine import Engine
    from doublesparse.testing import ByteTokenizer, tiny_llama

    e = Engine(model=tiny_llama(seed=0, max_position_embeddings=512), tokenizer=ByteTokenizer(),
               progress=False, max_total_tokens=4096, enable_double_sparsity=True,
               ds_heavy_token_ratio=0.25, ds_heavy_token_min=8, ds_heavy_token_max=64,
               ds_sparse_decode_threshold=40, ds_num_sink=1, ds_num_recent=2)
    seen = []
    real = e.parts.backend.decode_attention

    def spy(layer_id, q, batch, q_label=None):
        if layer_id == 0:
            seen.append((batch.ds_sparse, None if batch.k is None else batch.k.tolist(),
                         batch.seq_lens.tolist()))
        return real(layer_id, q, batch, q_label=q_label)

    monkeypatch.setattr(e.parts.backend, "decode_attention", spy)
    sp = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 12}
    short = e.generate([[7] * 20], sp)  # lengths 21..31: every step dense, without the sparse launches
    assert not any(s for s, _, _ in seen) and short[0]["meta"]["sparse_decode_steps"] == 0
    seen.clear()
    out = e.generate([[7] * 30, [9] * 100], sp)  # lengths 31..41 and 101..111 in one batch
    for sparse, ks, lens in seen:
        want = [min(64, max(8, math.ceil(n / 4))) if n >= 40 else DENSE for n in lens]
        assert ks == want and sparse == any(k != DENSE for k in want)
    assert len(seen) == 11 and all(s for s, _, _ in seen)  # the long request makes each step sparse
    assert out[0]["meta"]["sparse_decode_steps"] == 2 and out[1]["meta"]["sparse_decode_steps"] == 11


def test_top_p_budget_config_and_flags():
    """--ds-budget-mode top_p keeps the ratio (or fixed) k as the upper bound and the min as the
    lower one; fixed needs a k, ratio refuses one; top_p must be in (0, 1]."""
    b = EngineConfig(ds_budget_mode="top_p", ds_budget_top_p=0.9).token_budget(131072)
    assert b == TokenBudget(512, 8192, 1 / 16, 0.9) and b.mode == "top_p" and "0.9" in b.describe()
    assert b.k_for(60000) == 3750
    fixed = EngineConfig(ds_budget_mode="top_p", ds_heavy_token_num=300, ds_heavy_token_min=64)
    assert fixed.token_budget(8192) == TokenBudget(64, 300, 0.0, 0.95)
    assert EngineConfig(ds_heavy_token_num=300).budget_mode == "fixed" == TokenBudget.fixed(3).mode
    assert EngineConfig().budget_mode == "ratio" and EngineConfig().token_budget(8192).top_p == 0
    for bad in ({"ds_budget_mode": "fixed"}, {"ds_budget_mode": "ratio", "ds_heavy_token_num": 8},
                {"ds_budget_mode": "top_p", "ds_budget_top_p": 0.0}, {"ds_budget_top_p": 1.5},
                {"ds_budget_mode": "nucleus"}):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    with pytest.raises(ValueError):
        TokenBudget(1, 4, top_p=2.0)
    p = add_cli_args(__import__("argparse").ArgumentParser())
    c = from_cli_args(p.parse_args(["--ds-budget-mode", "top_p", "--ds-budget-top-p", "0.8"]))
    assert c.token_budget(131072).top_p == 0.8


def test_engine_hands_top_p_to_the_kernels(monkeypatch):
    """The backend passes the budget's top_p and lower bound to every sparse ds_decode."""
    from doublesparse.attention import double_sparsity
    from doublesparse.engine import Engine
    from doublesparse.testing import ByteTokenizer, tiny_llama

    e = Engine(model=tiny_llama(seed=0, max_position_embeddings=512), tokenizer=ByteTokenizer(),
               progress=False, max_total_tokens=4096, enable_double_sparsity=True, ds_heavy_token_num=32,
               ds_budget_mode="top_p", ds_budget_top_p=0.5, ds_heavy_token_min=8,
               ds_sparse_decode_threshold=40, ds_num_sink=1, ds_num_recent=2)
    seen = []
    real = double_sparsity.ops.ds_decode

    def spy(*args, **kw):
        a = args[10]  # its DSDecodeArgs
        seen.append((a.top_p, a.top_p_min_k))
        return real(*args, **kw)

    monkeypatch.setattr(double_sparsity.ops, "ds_decode", spy)
    out = e.generate([[7] * 60], {"temperature": 0, "ignore_eos": True, "max_new_tokens": 3})
    assert out[0]["meta"]["sparse_decode_steps"] == 2 and seen and set(seen) == {(0.5, 8)}
