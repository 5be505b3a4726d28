"""Why a request decoded densely (attention/decode_choice.py), as ``doublesparse generate`` says it."""

from doublesparse.attention.budget import DecodeCost, DecodePolicy, TokenBudget
from doublesparse.attention.decode_choice import dense_reason, sparse_from

# SmolLM2-135M-like costs (30 layers, 3 KV heads x 64, fp32 K/V, r=16 bf16 labels)
COST = DecodeCost(30 * 2 * 3 * 64 * 4, 30 * 3 * 16 * 2, 30 * 2 * 3 * 64 * 4, 2e10, 30 * 20e-6)


def test_short_request_reason_and_where_sparse_starts():
    pol = DecodePolicy(TokenBudget(512, 512, 1 / 16), None, COST)
    start = sparse_from(pol, 8192)
    assert start is not None and start > 512
    assert pol.plan([start])[1] and not pol.plan([start - 1])[1]
    msg = dense_reason(pol, 300, 8192)
    assert "300 tokens" in msg and "top-k (512)" in msg and f"from {start} tokens" in msg
    msg = dense_reason(pol, 600, 8192)
    assert "would save" in msg and "--ds-sparse-decode-threshold" in msg
    assert dense_reason(pol, 8000, 8192) is None


def test_threshold_and_never_sparse():
    pol = DecodePolicy(TokenBudget.fixed(64), 1000)
    assert sparse_from(pol, 8192) == 1000
    assert "below --ds-sparse-decode-threshold 1000" in dense_reason(pol, 700, 8192)
    assert "no request up to the context length (900)" in dense_reason(pol, 700, 900)
