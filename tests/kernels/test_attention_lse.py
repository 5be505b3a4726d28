"""ops.attention_lse: exact decode attention with each query head's log-sum-exp, over whole caches
or over given selections (per KV head, per query head, one shared row, per-row counts); the
Triton path (interpreter on CPU) against the PyTorch path and a from-scratch reference."""

import pytest
import torch

from conftest import DEVICE
from kernel_utils import make_case, make_ws
from doublesparse.kernels import ops


def _scratch(c, b, h, slots):
    G = c.q.shape[1] // c.k_cache.shape[1]
    k = c.k_cache[slots, h // G].float()
    s = (k @ c.q[b, h].float()) * c.sm_scale
    return torch.logsumexp(s, 0), torch.softmax(s, 0) @ c.v_cache[slots, h // G].float()


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("how", ["dense", "group", "per_head", "layer", "row_ks"])
def test_attention_lse(impl, how):
    if impl == "triton" and DEVICE == "cpu":
        import os
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    c = make_case([37, 70, 5], 6, 2, 32, r=4, dtype=torch.float32, device=DEVICE, seed=7)
    B, Hq, _ = c.q.shape
    Hkv, K = 2, 5
    g = torch.Generator().manual_seed(1)
    sel = ks = row_ks = None
    per_head = how == "per_head"
    if how != "dense":
        R = Hq if per_head else Hkv
        pos = torch.stack([torch.stack([torch.randperm(int(n), generator=g)[:K] for _ in range(R)])
                           for n in c.seq_lens.tolist()])                       # [B, R, K] positions
        sel = torch.gather(c.req_to_token[c.req_idx.long()].long()[:, None, :].expand(B, R, -1), 2,
                           pos.to(DEVICE)).int()
        if how == "layer":
            sel = sel[:, :1].expand(B, Hkv, K)
        ks = torch.full((B,), K, dtype=torch.int32, device=DEVICE)
        if how == "row_ks":
            row_ks = torch.randint(1, K + 1, (B, R), generator=g).int().to(DEVICE)
    ws = make_ws(c) if impl == "triton" else None
    out, lse = ops.attention_lse(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_idx, c.seq_lens, c.sm_scale,
                                 ws, sel=sel, k=ks, row_ks=row_ks, per_head=per_head, impl=impl)
    assert lse.shape == (B, Hq) and lse.dtype == torch.float32
    G = Hq // Hkv
    for b in range(B):
        for h in range(Hq):
            if sel is None:
                slots = c.req_to_token[int(c.req_idx[b]), :int(c.seq_lens[b])].long()
            else:
                r = h if per_head else h // G
                n = int(row_ks[b, r]) if row_ks is not None else K
                slots = sel[b, r, :n].long()
            want_lse, want_o = _scratch(c, b, h, slots)
            assert float(lse[b, h]) == pytest.approx(float(want_lse), abs=2e-3)
            assert torch.allclose(out[b, h].float(), want_o, atol=2e-3, rtol=2e-3)
