"""The Double Sparsity decode in one persistent launch (kernels/triton/ds_persistent.py): its
work-item order, and its output against the reference and the separate launches.

On CPU the kernel runs under the interpreter, where the first program runs every item in table
order; on a GPU the programs run concurrently and wait on each other's counters, so the GPU run
of these tests is what checks the synchronisation. There they run with a spin limit, so that a
synchronisation bug fails with the stalled item instead of hanging the GPU; then one test runs
the default build's unbounded waits, as do the engine's persistent tests in test_engine.py.
"""

import pytest
import torch

from conftest import DEVICE
from kernel_utils import (GRAPH_REPLAY_LENS, TOL, capture_graph, check_selection, expected_output, make_case,
                          make_ws, rel_err, rows_of)
from doublesparse.kernels.triton import ds_persistent as dp
from doublesparse.kernels.triton import launch
from doublesparse.kernels.triton.ds_persistent_launch import work_items

FP8 = torch.float8_e4m3fn
GPU_SPIN_LIMIT = 1 << 20  # polls of ~0.5-1 µs: about a second, where a healthy wait takes microseconds


@pytest.fixture(autouse=True)
def _spin_limit_on_gpu(monkeypatch):
    if DEVICE == "cuda":
        monkeypatch.setitem(launch.TUNING, "persistent_spin_limit", GPU_SPIN_LIMIT)


def _waits_for(kind, b, row, n):
    """The items that (kind, b, row, .) waits for, as (kind, b, row-or-None, count); with no
    HIST1 items (n_hist 0: the scores make the histogram) HIST2 waits for the entry's SCOREs."""
    n_score, n_hist, n_sel = n
    hist2 = (dp.HIST1, b, row, n_hist) if n_hist else (dp.SCORE, b, None, n_score)
    return {dp.HIST1: (dp.SCORE, b, None, n_score), dp.HIST2: hist2,
            dp.COMPACT: (dp.HIST2, b, row, n_sel), dp.ATTN: (dp.COMPACT, b, row, n_sel)}.get(kind)


@pytest.mark.parametrize("B,rows,lags", [(1, 3, (1, 2)), (3, 8, (1, 2)), (5, 9, (0, 0)), (4, 2, (2, 3)),
                                         (2, 4, (0, 3))])
@pytest.mark.parametrize("n_hist", [2, 0])
def test_work_items_come_after_what_they_wait_for(B, rows, lags, n_hist):
    n = (5, n_hist, 3)
    splits = 4
    items = work_items(B, rows, *n, splits, *lags)
    assert len(items) == len(set(items)) == B * (n[0] + rows * (n[1] + 2 * n[2] + splits))
    done: dict = {}
    for kind, b, row, p in items:
        dep = _waits_for(kind, b, row, n)
        if dep:
            k, db, drow, count = dep
            assert done.get((k, db, drow), 0) == count, (kind, b, row, p)
        key = (kind, b, None if kind == dp.SCORE else row)
        done[key] = done.get(key, 0) + 1


def test_work_items_refuse_lags_out_of_order():
    with pytest.raises(ValueError):
        work_items(2, 3, 1, 1, 1, 1, 2, 1)
    with pytest.raises(ValueError):
        work_items(2, 3, 1, 1, 1, 1, -1, 0)


CASES = [
    # seq_lens, hq, hkv, d, r, k
    ([5, 260, 77], 9, 3, 64, 8, 40),      # one short request takes the dense path
    ([129, 200, 64], 32, 8, 128, 32, 64),
    ([300], 9, 3, 64, 16, 1),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["per_head", "group_sum", "group_max"])
@pytest.mark.parametrize("label_dtype", [torch.bfloat16, FP8])
def test_persistent_decode_matches_reference(case, mode, label_dtype, monkeypatch):
    seq_lens, hq, hkv, d, r, k = case
    if DEVICE == "cpu" and label_dtype == FP8 and mode != "group_max":
        pytest.skip("interpreter time")
    monkeypatch.setitem(launch.TUNING, "ds_persistent", True)
    c = make_case(seq_lens, hq, hkv, d, r=r, label_dtype=label_dtype, device=DEVICE, seed=len(seq_lens) + k)
    ws = make_ws(c, max_heavy_tokens=k + 3)
    out = torch.full_like(c.q, float("nan"))
    _, sel = launch.ds_decode(*c.args(), c.sm_scale, k, mode, ws=ws, out=out, num_splits=3, return_sel=True)
    assert not out.isnan().any()
    check_selection(c, ws, sel, k, mode)
    assert rel_err(out, expected_output(c, sel, k, mode)) < TOL[torch.bfloat16]
    _assert_clean(ws)


def _assert_clean(ws):
    # Every counter back at zero for the next call (the last program out zeroes them).
    assert int(ws.persistent_sync.abs().sum()) == 0
    assert int(ws.hist[0].abs().sum()) == 0
    assert int(ws.split_count.abs().sum()) == 0


GEOMETRIES = [  # TUNING overrides: item sizes, lags, programs
    {},
    {"persistent_score_tokens": 64, "persistent_hist_items": 3, "persistent_select_items": 5,
     "persistent_select_lag": 0, "persistent_attn_lag": 0, "select_block_n": 64, "hist_block_n": 128},
    {"persistent_score_tokens": 100, "persistent_select_lag": 2, "persistent_attn_lag": 2,
     "persistent_programs_per_sm": 1, "select_prefetch": "", "select_atomic_hist": False},
    {"persistent_programs_per_sm": 64, "persistent_select_items": 16, "persistent_hist_items": 1},
    {"persistent_score_hist": True, "persistent_score_tokens": 128},  # no HIST1 items (group modes)
]


@pytest.mark.parametrize("tuning", GEOMETRIES, ids=str)
@pytest.mark.parametrize("mode", ["per_head", "group_max"])
def test_persistent_decode_equals_separate_launches(tuning, mode, monkeypatch):
    """Over repeated calls on one workspace, with any item geometry: the selection of the separate
    Triton launches (the same fp16 scores), and their output up to the merge's rounding."""
    _compare_with_separate_launches(tuning, mode, monkeypatch)


def _compare_with_separate_launches(tuning, mode, monkeypatch):
    for key, val in {"score_impl": "mma", "select_impl": "triton", **tuning}.items():
        monkeypatch.setitem(launch.TUNING, key, val)
    ws = None
    for i, (seq_lens, k) in enumerate([([300, 41, 517], 40), ([129, 260], 64), ([520], 16)]):
        c = make_case(seq_lens, 9, 3, 64, r=16, device=DEVICE, seed=31 + i, max_ctx=520)
        ws = ws or make_ws(c, max_heavy_tokens=64)
        got = {}
        for persistent in (False, True):
            monkeypatch.setitem(launch.TUNING, "ds_persistent", persistent)
            out = torch.full_like(c.q, float("nan"))
            _, sel = launch.ds_decode(*c.args(), c.sm_scale, k, mode, ws=ws, out=out, num_splits=4,
                                      return_sel=True)
            got[persistent] = (out, sel.clone(), ws.scores.clone())
        rows = rows_of(mode, 9, 3)
        for b, n in enumerate(seq_lens):
            if n > k:
                assert torch.equal(got[True][1][b, :, :k], got[False][1][b, :, :k])
                assert torch.equal(got[True][2][b, :rows, :n], got[False][2][b, :rows, :n])
        assert rel_err(got[True][0], got[False][0]) < 1e-3
        _assert_clean(ws)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("tuning", GEOMETRIES[:3], ids=str)
def test_persistent_decode_in_cuda_graph(tuning, monkeypatch):
    """Captured once, replayed with new lengths and contents: equals eager, and the reference."""
    for key, val in {"ds_persistent": True, **tuning}.items():
        monkeypatch.setitem(launch.TUNING, key, val)
    c = make_case([600, 600, 600], 32, 8, 128, r=16, device=DEVICE, seed=5)
    ws = make_ws(c, max_heavy_tokens=64, poison=False)
    out = torch.empty_like(c.q)

    def step():
        launch.ds_decode(*c.args(), c.sm_scale, 64, "group_max", ws=ws, out=out)

    graph = capture_graph(step)  # the item table is built outside the capture
    for lens in GRAPH_REPLAY_LENS:
        c.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        c.q.normal_()
        for _ in range(3):  # replays back to back: the counters reset themselves
            graph.replay()
        got = out.clone()
        _, sel = launch.ds_decode(*c.args(), c.sm_scale, 64, "group_max", ws=ws, out=out, return_sel=True)
        assert torch.equal(got, out)
        assert rel_err(out, expected_output(c, sel, 64, "group_max")) < TOL[torch.bfloat16]
    _assert_clean(ws)


def test_persistent_geometry_out_of_range_is_refused(monkeypatch):
    from doublesparse.kernels.workspace import SELECT_MAX_PROGS
    monkeypatch.setitem(launch.TUNING, "ds_persistent", True)
    c = make_case([50], 9, 3, 64, device=DEVICE, seed=2)
    ws = make_ws(c, max_heavy_tokens=8)
    for key, val in (("persistent_select_items", SELECT_MAX_PROGS + 1), ("persistent_hist_items", 0),
                     ("persistent_attn_lag", 0)):
        with monkeypatch.context() as m:
            m.setitem(launch.TUNING, key, val)
            with pytest.raises(ValueError):
                launch.ds_decode(*c.args(), c.sm_scale, 8, "group_max", ws=ws)


def test_persistent_decode_reports_a_stalled_wait(monkeypatch):
    """With a spin limit, a wait whose items never arrive (here: entry 0's score counter poisoned)
    gives up and the call names the item, instead of hanging; the next call is clean and right."""
    monkeypatch.setitem(launch.TUNING, "ds_persistent", True)
    limit = 50 if DEVICE == "cpu" else 1 << 14  # on a GPU, long enough for every healthy wait
    monkeypatch.setitem(launch.TUNING, "persistent_spin_limit", limit)
    c = make_case([300, 41], 9, 3, 64, device=DEVICE, seed=12)
    ws = make_ws(c, max_heavy_tokens=40)
    ws.persistent_sync[0, 0] = -1000
    # The first wait to give up: on a GPU any of entry 0's HIST1 items (they run concurrently).
    with pytest.raises(RuntimeError, match=rf"\(HIST1, entry 0, row \d+, slice \d+\) gave up after {limit} polls"):
        launch.ds_decode(*c.args(), c.sm_scale, 40, "group_max", ws=ws)
    _assert_clean(ws)
    out = torch.full_like(c.q, float("nan"))
    _, sel = launch.ds_decode(*c.args(), c.sm_scale, 40, "group_max", ws=ws, out=out, return_sel=True)
    assert rel_err(out, expected_output(c, sel, 40, "group_max")) < TOL[torch.bfloat16]
    monkeypatch.setitem(launch.TUNING, "persistent_spin_limit", -1)
    with pytest.raises(ValueError, match="persistent_spin_limit"):
        launch.ds_decode(*c.args(), c.sm_scale, 40, "group_max", ws=ws)


def _random_valid_order(seed):
    """work_items, shuffled into a random order that still puts every item after what it waits
    for: the kernel must rely on nothing else (e.g. on the order of a row's slices)."""
    import random

    def order(B, rows, n_score, n_hist, n_sel, n_splits, select_lag, attn_lag):
        rng = random.Random(seed)
        n = (n_score, n_hist, n_sel)
        todo = work_items(B, rows, n_score, n_hist, n_sel, n_splits, select_lag, attn_lag)
        rng.shuffle(todo)
        done, out = {}, []
        while todo:
            for i, (kind, b, row, p) in enumerate(todo):
                dep = _waits_for(kind, b, row, n)
                if dep is None or done.get(dep[:3], 0) == dep[3]:
                    break
            kind, b, row, p = todo.pop(i)
            out.append((kind, b, row, p))
            key = (kind, b, None if kind == dp.SCORE else row)
            done[key] = done.get(key, 0) + 1
        return out
    return order


@pytest.mark.parametrize("seed,score_hist", [(0, False), (1, False), (2, True)])
def test_persistent_decode_in_any_valid_item_order(seed, score_hist, monkeypatch):
    from doublesparse.kernels.triton import ds_persistent_launch
    monkeypatch.setitem(launch.TUNING, "ds_persistent", True)
    monkeypatch.setitem(launch.TUNING, "persistent_score_hist", score_hist)
    monkeypatch.setitem(launch.TUNING, "persistent_score_tokens", 64)
    monkeypatch.setitem(launch.TUNING, "select_block_n", 64)
    monkeypatch.setitem(launch.TUNING, "hist_block_n", 64)
    monkeypatch.setattr(ds_persistent_launch, "work_items", _random_valid_order(seed))
    monkeypatch.setattr(ds_persistent_launch, "_TABLES", {})
    c = make_case([300, 41, 257], 9, 3, 64, device=DEVICE, seed=40 + seed)
    k = 40
    ws = make_ws(c, max_heavy_tokens=k)
    out = torch.full_like(c.q, float("nan"))
    _, sel = launch.ds_decode(*c.args(), c.sm_scale, k, "group_max", ws=ws, out=out, return_sel=True)
    check_selection(c, ws, sel, k, "group_max")
    assert rel_err(out, expected_output(c, sel, k, "group_max")) < TOL[torch.bfloat16]
    _assert_clean(ws)


@pytest.mark.skipif(DEVICE != "cuda", reason="the CPU runs every test here with unbounded waits")
@pytest.mark.parametrize("tuning", GEOMETRIES, ids=str)
def test_persistent_decode_with_unbounded_waits(tuning, monkeypatch):
    """The same comparison on a GPU with the waits of the default build (no spin limit), last in this
    file: once the bounded ones have passed (a bug there fails instead of hanging)."""
    monkeypatch.setitem(launch.TUNING, "persistent_spin_limit", 0)
    _compare_with_separate_launches(tuning, "group_max", monkeypatch)
