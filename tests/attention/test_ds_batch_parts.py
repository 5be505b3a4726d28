"""The Double Sparsity backend with its decode batch cut into parts (``DSParams.batch_parts``):
each part on its own workspace rows (and, on CUDA, its own stream) gives the uncut output."""

from types import SimpleNamespace

import pytest
import torch

from doublesparse.attention.batch import ForwardBatch

from conftest import DEVICE
from kernel_utils import TOL, make_case, make_ws, rel_err
from doublesparse.attention import DSParams, create_backend
from doublesparse.attention.budget import DENSE
from doublesparse.attention.double_sparsity import cut_batch, device_k


def test_cut_batch():
    assert cut_batch(16, 2) == [(0, 8), (8, 16)]
    assert cut_batch(3, 2) == [(0, 2), (2, 3)] or cut_batch(3, 2) == [(0, 1), (1, 3)]
    assert cut_batch(2, 4) == [(0, 1), (1, 2)]
    assert cut_batch(5, 1) == [(0, 5)]
    for B in range(1, 20):
        for p in range(1, 6):
            parts = cut_batch(B, p)
            assert parts[0][0] == 0 and parts[-1][1] == B and len(parts) == min(B, p)
            assert all(b > a for a, b in parts) and all(x[1] == y[0] for x, y in zip(parts, parts[1:]))


def test_device_k():
    """DSParams -> each request's k on the device: k_max where the request decodes sparsely
    (seq_len > k and seq_len >= threshold, the backend's host rule too), else DENSE; int32."""
    lens = torch.tensor([30, 40, 41, 99, 100, 500], dtype=torch.int32)
    dense = torch.tensor(DENSE, dtype=torch.int32)
    for thr, want in ((100, [DENSE] * 4 + [40, 40]), (10, [DENSE, DENSE] + [40] * 4), (0, [DENSE, DENSE] + [40] * 4)):
        got = device_k(DSParams(40, threshold=thr), lens, dense)
        assert got.dtype == torch.int32 and got.tolist() == want
        assert [k != DENSE for k in want] == [n > 40 and n >= thr for n in lens.tolist()]


@pytest.mark.parametrize("parts", [2, 3])
def test_batch_parts_match_uncut(parts):
    c = make_case([300, 90, 257, 140, 33], 9, 3, 64, device=DEVICE, seed=31)  # 90 and 33: dense
    k = 40
    mem = SimpleNamespace(k=[c.k_cache], v=[c.v_cache], label=[c.label_cache], label_scale=[c.label_scale],
                          req_to_token=c.req_to_token)
    batch = ForwardBatch(mode="decode", req_idx=c.req_idx, seq_lens=c.seq_lens)
    outs = []
    for n in (1, parts):
        be = create_backend("double_sparsity", use_double_sparsity=True,
                            ds=DSParams(k, "group_max", 100, 2, 4, batch_parts=n), memory=mem,
                            num_q_heads=9, head_dim=64, impl="triton",
                            workspace=make_ws(c, k_max=k), channels=c.channels[None])
        outs.append(be.decode_attention(0, c.q, batch))
    assert not outs[1].isnan().any()
    assert rel_err(outs[1], outs[0]) < TOL[torch.bfloat16]


def test_auto_parts():
    """Auto (batch_parts=0): 2 parts from AUTO_PARTS_MIN_BATCH requests, else 1."""
    from doublesparse.attention.double_sparsity import AUTO_PARTS_MIN_BATCH
    c = make_case([20] * AUTO_PARTS_MIN_BATCH, 9, 3, 64, device=DEVICE, seed=1)
    mem = SimpleNamespace(k=[c.k_cache], v=[c.v_cache], label=[c.label_cache], label_scale=[c.label_scale],
                          req_to_token=c.req_to_token)
    be = create_backend("double_sparsity", use_double_sparsity=True, ds=DSParams(8), memory=mem,
                        num_q_heads=9, head_dim=64, impl="triton",
                        workspace=make_ws(c, k_max=8), channels=c.channels[None])
    assert len(be._batch_parts(AUTO_PARTS_MIN_BATCH - 1)) == 1
    assert len(be._batch_parts(AUTO_PARTS_MIN_BATCH)) == 2


def test_plan_builds_each_layers_args_once(monkeypatch):
    """A sparse decode step's plan: one DSDecodeArgs per layer, shared by the layers of one mode,
    holding the batch's own k tensor (in a CUDA graph, the static buffer the graph reads) and
    DSParams' values; decode hands the kernels exactly that object. A dense step's plan holds
    none; a batch that was not planned (nor given k) gets DSParams' k, made on the device."""
    from doublesparse.attention import double_sparsity
    from doublesparse.kernels.tuning import KernelTuning
    c = make_case([300, 30], 9, 3, 64, seed=3)
    L = 3
    mem = SimpleNamespace(k=[c.k_cache] * L, v=[c.v_cache] * L, label=[c.label_cache] * L,
                          label_scale=[c.label_scale] * L, req_to_token=c.req_to_token)
    ds = DSParams(40, "group_max", 0, 2, 4, layer_modes=("group_max", "per_head", "group_max"))
    tuning = KernelTuning(select_impl="triton")
    be = create_backend("double_sparsity", use_double_sparsity=True, ds=ds, memory=mem, num_q_heads=9,
                        head_dim=64, impl="torch", channels=torch.stack([c.channels] * L), tuning=tuning)
    k = torch.tensor([40, DENSE], dtype=torch.int32)
    batch = ForwardBatch(mode="decode", req_idx=c.req_idx, seq_lens=c.seq_lens, k=k, ds_sparse=True)
    be.plan(batch)
    a = batch.attn_meta
    assert len(a) == L and a[0] is a[2] and a[1] is not a[0] and all(x.k is k for x in a)
    assert [x.mode for x in a] == ["group_max", "per_head", "group_max"]
    assert {(x.k_max, x.num_sink, x.num_recent, x.top_p, x.tuning) for x in a} == {(40, 2, 4, 0.0, tuning)}
    seen = []
    real = double_sparsity.ops.ds_decode
    monkeypatch.setattr(double_sparsity.ops, "ds_decode", lambda *p, **kw: seen.append(p[10]) or real(*p, **kw))
    for layer in range(L):
        be.decode_attention(layer, c.q, batch)
    assert len(seen) == L and all(s is x for s, x in zip(seen, a))
    dense = ForwardBatch(mode="decode", req_idx=c.req_idx, seq_lens=c.seq_lens, k=k, ds_sparse=False)
    be.plan(dense)
    assert dense.attn_meta is None
    bare = ForwardBatch(mode="decode", req_idx=c.req_idx, seq_lens=c.seq_lens)
    assert be.layer_args(1, bare).k.tolist() == [40, DENSE] and be.layer_args(1, bare).mode == "per_head"
