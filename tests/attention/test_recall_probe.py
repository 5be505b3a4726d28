"""The sampled attention recall (attention/recall.py): exact on cases whose attention is known, the
probe measures what decode selected (PyTorch path, and the Triton stash under TRITON_INTERPRET=1),
and the sampling interval and row cap bound the work."""

import math
import os
from types import SimpleNamespace

import pytest
import torch

from doublesparse.attention.batch import ForwardBatch

from kernel_utils import make_case, make_ws
from doublesparse.attention import DSParams, create_backend
from doublesparse.attention.budget import DENSE
from doublesparse.attention.recall import RecallConfig, RecallProbe, exact_recall
from doublesparse.attention.recall_stats import RECALL_BUCKETS, RecallStats, layer_groups


def test_exact_recall_known_attention():
    """q = e0, k_j = (log w_j, 0, ...): the softmax weights are w / sum(w); the recall of a
    selection is its share of w, and the output error that of the renormalised sparse output."""
    w = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0])
    n, D = len(w), 4
    k = torch.zeros(n, 1, D)
    k[:, 0, 0] = w.log()
    v = torch.zeros(n, 1, D)
    v[:, 0, 1] = torch.arange(n, dtype=torch.float32)
    v[:, 0, 2] = 1.0
    q = torch.zeros(1, D)
    q[0, 0] = 1.0
    sel = torch.tensor([[4, 1]])                       # slots = positions here
    p = w / w.sum()
    exact_o = (p[:, None] * v[:, 0]).sum(0)
    ps = w[[4, 1]] / w[[4, 1]].sum()
    sparse_o = (ps[:, None] * v[[4, 1], 0]).sum(0)
    recall, err = exact_recall(q, sparse_o[None], sel, None, k, v, torch.arange(n), 1.0)
    assert recall.tolist() == pytest.approx([12 / 20], abs=1e-6)
    want_err = float((sparse_o - exact_o).norm() / exact_o.norm())
    assert float(err) == pytest.approx(want_err, rel=1e-5)
    # the exact output has no error; a top-p mask drops entries from the mass
    recall, err = exact_recall(q, exact_o[None], sel, torch.tensor([[True, False]]), k, v, torch.arange(n), 1.0)
    assert recall.tolist() == pytest.approx([10 / 20], abs=1e-6) and float(err) < 1e-6


def test_exact_recall_rows_per_kv_head_and_per_head():
    """GQA: a KV head's selection serves its query heads (group modes), or each query head has
    its own (per_head); slots scattered in the pool."""
    g = torch.Generator().manual_seed(0)
    n, Hq, Hkv, D = 40, 4, 2, 8
    S = 64
    slots = torch.randperm(S, generator=g)[:n]
    kc, vc = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    q = torch.randn(Hq, D, generator=g)
    scale = D ** -0.5
    s = torch.einsum("hd,nhd->hn", q, kc[slots].repeat_interleave(2, 1)) * scale
    p = s.softmax(-1)                                                   # [Hq, n]
    pos = torch.stack([torch.randperm(n, generator=g)[:10] for _ in range(Hq)])
    got, _ = exact_recall(q, q, slots[pos], None, kc, vc, slots, scale)
    assert torch.allclose(got, torch.gather(p, 1, pos).sum(-1), atol=1e-5)
    kv_pos = pos[::2]                                                  # rows of KV heads 0, 1
    got, _ = exact_recall(q, q, slots[kv_pos], None, kc, vc, slots, scale)
    want = torch.gather(p, 1, kv_pos.repeat_interleave(2, 0)).sum(-1)
    assert torch.allclose(got, want, atol=1e-5)


def _case(seq_lens, hq=4, hkv=2, d=16, seed=3):
    # labels over every channel (r = d) in float32: the selection is the exact top-k of the scores
    return make_case(seq_lens, hq, hkv, d, r=d, dtype=torch.float32, label_dtype=torch.float32, seed=seed)


def _backend(c, k, impl="torch", mode="group_max", top_p=0.0):
    mem = SimpleNamespace(k=[c.k_cache] * 2, v=[c.v_cache] * 2, label=[c.label_cache] * 2,
                          label_scale=[c.label_scale] * 2, req_to_token=c.req_to_token)
    from doublesparse.attention.budget import DecodePolicy, TokenBudget
    pol = DecodePolicy(TokenBudget(min(4, k), k, 0.0, top_p), 0)
    ws = make_ws(c, k_max=k, layer_select=mode == "layer") if impl == "triton" else None
    return create_backend("double_sparsity", use_double_sparsity=True, ds=DSParams(k, mode, 0, policy=pol),
                          memory=mem, num_q_heads=c.q.shape[1], head_dim=c.q.shape[2], impl=impl,
                          workspace=ws, channels=torch.stack([c.channels] * 2))


def _step(be, probe, c, ks, layers=2):
    B = c.q.shape[0]
    batch = ForwardBatch(mode="decode", req_idx=c.req_idx, seq_lens=c.seq_lens, ds_sparse=True,
                            k=torch.tensor(ks, dtype=torch.int32))
    rows, lens = c.req_idx.tolist(), c.seq_lens.tolist()
    probe.begin_step(rows, [n - 1 for n in lens], (ks, True))
    outs = [be.decode_attention(layer, c.q, batch) for layer in range(layers)]
    probe.end_step()
    assert len(outs) == layers and B == len(rows)


def _top_mass(c, b, k):
    """Recall of the exact top-k per query head (what full-channel labels select, group_max over
    a group being the top-k of each KV head's max score)."""
    n, row = int(c.seq_lens[b]), int(c.req_idx[b])
    slots = c.req_to_token[row, :n].long()
    Hq, D = c.q.shape[1:]
    Hkv = c.k_cache.shape[1]
    G = Hq // Hkv
    s = torch.einsum("hgd,nhd->hgn", c.q[b].view(Hkv, G, D), c.k_cache[slots]) * D ** -0.5
    p = s.softmax(-1)
    top = s.amax(1).topk(k, -1).indices                                   # [Hkv, k]
    return torch.gather(p, 2, top[:, None].expand(-1, G, -1)).sum(-1).mean().item()


def test_probe_measures_the_step_selection():
    c = _case([60, 30, 90])
    k = 12
    be = _backend(c, k)
    probe = RecallProbe(RecallConfig(interval=1, rows=4), be, num_layers=2)
    probe.attach(be)
    ks = [k, DENSE, k]                                                      # row 1 decodes densely
    _step(be, probe, c, ks)
    st = probe.summary()
    assert st["samples"] == 2 and st["sampled_steps"] == 1 and st["layers"][1] is None
    want = [_top_mass(c, 0, k), _top_mass(c, 2, k)]
    assert st["recall_mean"] == pytest.approx(sum(want) / 2, abs=1e-4)
    assert st["recall_min"] == pytest.approx(min(want), abs=1e-4)
    assert 0 < st["rel_error_mean"] < 1
    # per request: its row's samples, once
    row0 = int(c.req_idx[0])
    got = probe.take_request(row0)
    assert got["samples"] == 1 and got["recall_mean"] == pytest.approx(want[0], abs=1e-4)
    assert probe.take_request(row0)["samples"] == 0
    _step(be, probe, c, ks)                                                 # the next layer's turn
    assert probe.summary()["layers"][1] is not None


def test_full_budget_recall_is_one():
    c = _case([40, 25])
    be = _backend(c, 39)
    probe = RecallProbe(RecallConfig(interval=1), be, num_layers=2)
    probe.attach(be)
    _step(be, probe, c, [39, 24])                                           # all but one token
    st = probe.summary()
    assert st["samples"] == 2 and st["recall_min"] > 0.9
    assert st["recall_mean"] <= 1.0


def test_sampling_interval_and_rows_bound_the_work():
    c = _case([50] * 6)
    be = _backend(c, 8)
    probe = RecallProbe(RecallConfig(interval=4, rows=2), be, num_layers=2)
    probe.attach(be)
    calls = []
    inner = probe.measure
    probe.measure = lambda a: (calls.append(len(a.req_rows)), inner(a))[1]
    for _ in range(20):
        _step(be, probe, c, [8] * 6)
    # dense steps are not counted: only sparse ones tick the interval
    probe.begin_step(c.req_idx.tolist(), [49] * 6, ([DENSE] * 6, False))
    probe.end_step()
    assert calls == [2] * 5
    st = probe.summary()
    assert st["sparse_decode_steps"] == 20 and st["sampled_steps"] == 5 and st["samples"] == 10
    # rows rotate over the batch and layers over the model
    assert sum(t.count for t in probe.stats.layers) == 10
    assert all(t.count > 0 for t in probe.stats.layers)
    assert RecallProbe(RecallConfig(interval=0), be, 2).begin_step([1], [49], ([8], True)) is False


@pytest.mark.parametrize("top_p,mode", [(0.0, "group_max"), (0.9, "group_max"), (0.0, "per_head"),
                                        (0.0, "layer")])
def test_triton_stash_matches_torch_path(top_p, mode):
    """The Triton path keeps the workspace's selection (the stash kernel, gated by the device
    control word) and measures the same recall as the PyTorch path's recomputed selection."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    c = _case([40, 33], hq=4, hkv=2, d=16, seed=5)
    k = 8
    got, errs = [], []
    for impl in ("torch", "triton"):
        be = _backend(c, k, impl, mode, top_p=top_p)
        probe = RecallProbe(RecallConfig(interval=2, rows=2), be, num_layers=2)
        probe.attach(be)
        for _ in range(2):
            _step(be, probe, c, [k, k])
        st = probe.summary()
        assert st["samples"] == 2
        got.append(st["recall_mean"])
        errs.append(st["rel_error_mean"])
        if impl == "triton":
            assert probe._ctl.tolist()[0] == -1                              # disarmed
    assert got[1] == pytest.approx(got[0], abs=2e-3)
    assert errs[1] == pytest.approx(errs[0], abs=2e-3)


def test_stats_histogram_and_groups():
    assert layer_groups(10, 4) == [(0, 1), (2, 4), (5, 7), (8, 9)]
    assert layer_groups(2, 4) == [(0, 0), (1, 1)]
    st = RecallStats(4, 2)
    for layer, r in ((0, 0.3), (1, 0.96), (3, 1.0), (3, 0.999)):
        st.add(layer, 5, r, 0.1)
    s = st.summary()
    g0, g1 = s["groups"]
    assert g0["layers"] == "0-1" and g0["count"] == 2 and g0["sum"] == pytest.approx(1.26)
    assert g0["cumulative_counts"][0] == 1 and g0["cumulative_counts"][-1] == 2
    assert g1["cumulative_counts"][RECALL_BUCKETS.index(0.999)] == 1
    assert s["samples"] == 4 and s["recall_min"] == 0.3 and s["layers"][2] is None
    assert st.take_row(5)["samples"] == 4 and math.isclose(st.ema[3], 0.9999)


def test_unsampled_steps_launch_nothing(monkeypatch):
    """Steps the probe does not sample reach neither the stash kernel nor the PyTorch copies; a
    sampled eager step stashes at its layer only; while the runner captures the sampled steps'
    graph (``capturing(True)``) every layer launches the stash (the device word picks the layer)."""
    import doublesparse.kernels.triton.recall_stash as rs
    c = _case([50, 44])
    be = _backend(c, 8)
    probe = RecallProbe(RecallConfig(interval=3), be, num_layers=2)
    probe.attach(be)
    assert be.recall_probe is probe
    probe.triton = True                      # the launch decision only: the kernel is replaced
    monkeypatch.setattr(be, "workspace", SimpleNamespace(sel_slot=None))
    launches = []
    monkeypatch.setattr(rs, "recall_stash", lambda *a: launches.append(a[-2]))
    monkeypatch.setattr(probe, "measure", lambda a: torch.zeros(len(a.req_rows), 2))
    probe._ctl = torch.full((3,), -1, dtype=torch.int32)
    probe._ctl_host = probe._ctl.clone()
    probe._q = probe._o = probe._sel = probe._rowk = None
    for _ in range(6):
        _step(be, probe, c, [8, 8])
    assert launches == [0, 1]                # steps 3 and 6, their layers in turn
    launches.clear()
    with probe.capturing(True):
        batch = ForwardBatch(mode="decode", req_idx=c.req_idx, seq_lens=c.seq_lens, ds_sparse=True,
                             k=torch.tensor([8, 8], dtype=torch.int32))
        be.decode_attention(0, c.q, batch)
        be.decode_attention(1, c.q, batch)
    assert launches == [0, 1] and probe._capture_stash is False


def test_triton_stash_in_every_layer_measures_the_same():
    """The sampled steps' CUDA graph launches the stash after every layer and lets the device word
    pick the layer; the recall it measures equals the eager step's (one launch, at that layer).
    The layers' queries differ (scaled), so a stash of the wrong layer would show."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    c = _case([40, 33], hq=4, hkv=2, d=16, seed=7)
    batch = ForwardBatch(mode="decode", req_idx=c.req_idx, seq_lens=c.seq_lens, ds_sparse=True,
                         k=torch.tensor([8, 8], dtype=torch.int32))
    got = []
    for every_layer in (False, True):
        be = _backend(c, 8, "triton")
        probe = RecallProbe(RecallConfig(interval=1, rows=2), be, num_layers=2)
        probe.attach(be)
        for _ in range(2):
            probe.begin_step(c.req_idx.tolist(), [n - 1 for n in c.seq_lens.tolist()], ([8, 8], True))
            with probe.capturing(every_layer):
                for layer in range(2):
                    be.decode_attention(layer, c.q * (1 + 2 * layer), batch)
            probe.end_step()
        st = probe.summary()
        assert st["samples"] == 4
        got.append([*st["layers"], st["recall_min"], st["rel_error_mean"]])
    assert abs(got[0][0] - got[0][1]) > 1e-3
    assert got[1] == pytest.approx(got[0], abs=1e-6)
