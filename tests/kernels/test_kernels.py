"""Every kernel against its float32 reference, on fresh random inputs, with poisoned outputs.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (see conftest.py), so sizes stay small;
on a GPU the same tests run compiled.
"""

import pytest
import torch

from conftest import DEVICE
from kernel_utils import (GRAPH_REPLAY_LENS, TOL, budgets, capture_graph, check_selection as _check_selection,
                          expected_output as _expected_output, make_case, make_ws, ref, rel_err, rows_of)
from doublesparse.attention.budget import DENSE
from doublesparse.kernels import ops
from doublesparse.kernels.ops import DSDecodeArgs
from doublesparse.kernels.triton import ds_launch, launch
from doublesparse.kernels.tuning import KernelTuning

FP8 = torch.float8_e4m3fn
HEADS = [(9, 3), (32, 8), (32, 32)]


def _seed(*xs):
    return abs(hash(xs)) % (2**31)


# ---------------------------------------------------------------- store
@pytest.mark.parametrize("n", [1, 17, 100])
@pytest.mark.parametrize("hkv,d,r", [(3, 64, 16), (8, 128, 32), (2, 64, 8)])
@pytest.mark.parametrize("label_dtype", [torch.bfloat16, FP8])
def test_store(n, hkv, d, r, label_dtype):
    g = torch.Generator().manual_seed(_seed(n, hkv, d, r))
    S = n + 9
    k = torch.randn(n, hkv, d, generator=g).bfloat16().to(DEVICE)
    v = torch.randn(n, hkv, d, generator=g).bfloat16().to(DEVICE)
    slots = (torch.randperm(S - 1, generator=g)[:n] + 1).int().to(DEVICE)
    channels = torch.stack([torch.randperm(d, generator=g)[:r] for _ in range(hkv)]).int().to(DEVICE)
    scale = torch.tensor([0.03], device=DEVICE)
    caches = [torch.full((S, hkv, d), 7.0, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    lab = torch.full((S, hkv, r), 7.0, device=DEVICE).to(label_dtype)
    exp = [c.clone() for c in caches] + [lab.clone()]
    ops.store_kv(caches[0], caches[1], k, v, slots, lab, scale, channels, impl="triton")
    ref.store_ref(exp[0], exp[1], exp[2], scale, k, v, slots, channels)
    assert torch.equal(caches[0], exp[0]) and torch.equal(caches[1], exp[1])
    # fp8 labels bit for bit (IEEE division, round to nearest even), the interpreter included
    assert torch.equal(lab.float(), exp[2].float())


def test_store_without_labels():
    k = torch.randn(5, 3, 64).bfloat16().to(DEVICE)
    kc = torch.zeros(9, 3, 64, dtype=torch.bfloat16, device=DEVICE)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([3, 1, 8, 2, 5], dtype=torch.int32, device=DEVICE)
    ops.store_kv(kc, vc, k, k * 2, slots, impl="triton")
    assert torch.equal(kc[slots.long()], k) and torch.equal(vc[slots.long()], k * 2)


@pytest.mark.skipif(DEVICE == "cpu", reason="millions of labels: compiled kernels only")
def test_store_fp8_labels_bit_exact_at_scale():
    """8M fp8 labels with an awkward scale equal the reference bit for bit: an approximate division
    (2 ulp) lands a few of millions on the other side of a rounding midpoint, enough to move a
    top-k between two stores of the same K (the in-GPU pools against DS-Offload's)."""
    g = torch.Generator(device=DEVICE).manual_seed(11)
    n, hkv, d, r = 65536, 8, 128, 16
    k = torch.randn(n, hkv, d, generator=g, device=DEVICE).bfloat16() * 3
    slots = torch.arange(n, dtype=torch.int32, device=DEVICE)
    channels = torch.stack([torch.randperm(d, device=DEVICE, generator=g)[:r] for _ in range(hkv)]).int()
    scale = torch.tensor([0.0371], device=DEVICE)
    kc = torch.empty(n, hkv, d, dtype=torch.bfloat16, device=DEVICE)
    lab, want = (torch.zeros(n, hkv, r, device=DEVICE).to(FP8) for _ in range(2))
    ops.store_kv(kc, torch.empty_like(kc), k, k, slots, lab, scale, channels, impl="triton")
    ref.store_labels_ref(want, scale, k, slots, channels)
    assert torch.equal(lab.view(torch.uint8), want.view(torch.uint8))


# ---------------------------------------------------------------- dense decode
@pytest.mark.parametrize("seq_lens", [[1], [37, 5, 130], [3] * 17])
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("d", [64, 128])
def test_dense_decode(seq_lens, hq, hkv, d):
    if DEVICE == "cpu" and len(seq_lens) * hq > (64 if d == 128 else 160):
        pytest.skip("too slow under the interpreter (the 17-request batch runs with 9 heads)")
    c = make_case(seq_lens, hq, hkv, d, device=DEVICE, seed=_seed(tuple(seq_lens), hq, d))
    for splits in (1, 3):
        ws = make_ws(c)
        out = torch.full_like(c.q, float("nan"))
        launch.dense_decode(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_idx, c.seq_lens,
                            c.sm_scale, ws, out=out, num_splits=splits)
        exp = ref.dense_decode_ref(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_idx,
                                   c.seq_lens, c.sm_scale)
        assert not out.isnan().any()
        assert rel_err(out, exp) < TOL[torch.bfloat16]


def test_dense_decode_fp16_fp32():
    for dt in (torch.float16, torch.float32):
        c = make_case([40, 9], 4, 2, 64, dtype=dt, device=DEVICE, seed=3)
        out = ops.dense_decode(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_idx, c.seq_lens,
                               c.sm_scale, make_ws(c), impl="triton")
        exp = ref.dense_decode_ref(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_idx,
                                   c.seq_lens, c.sm_scale)
        # fp32 dots run as tf32 on the GPU's tensor cores (about 1e-3 relative error).
        tol = 3e-3 if (dt == torch.float32 and DEVICE == "cuda") else TOL[dt] * 3
        assert out.dtype == dt and rel_err(out, exp) < tol


# ---------------------------------------------------------------- double sparsity
CASES = [
    # seq_lens, hq, hkv, d, r, k
    ([300], 9, 3, 64, 16, 32),
    ([5, 260, 77], 9, 3, 64, 8, 40),      # one short request takes the dense path
    ([129, 200, 64], 32, 8, 128, 32, 64),
    ([90], 32, 32, 64, 16, 1),
    ([50, 50], 4, 2, 64, 16, 49),         # k = L - 1
    ([33] * 17, 9, 3, 64, 16, 16),        # batch 17
    ([211], 6, 2, 64, 48, 24),            # r = 48: an odd number of 16-channel pieces per label row
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["per_head", "group_sum", "group_max"])
@pytest.mark.parametrize("label_dtype", [torch.bfloat16, FP8])
def test_ds_decode(case, mode, label_dtype):
    seq_lens, hq, hkv, d, r, k = case
    if DEVICE == "cpu" and label_dtype == FP8 and len(seq_lens) > 3:
        pytest.skip("interpreter time")
    if DEVICE == "cpu" and mode == "per_head" and (len(seq_lens) > 3 or d >= 128):
        pytest.skip("interpreter time (per_head runs Hq selection rows; the other cases cover it: "
                    "32 rows in case 3, d = 128 and r = 32 in the group modes)")
    if DEVICE == "cpu" and (label_dtype == FP8 or len(seq_lens) > 3) and mode == "group_sum":
        pytest.skip("interpreter time (fp8 labels dequantize before the mode's aggregation: "
                    "group_max and per_head cover them; batch 17 runs with group_max)")
    c = make_case(seq_lens, hq, hkv, d, r=r, label_dtype=label_dtype, device=DEVICE,
                  seed=_seed(tuple(seq_lens), mode, str(label_dtype)))
    ws = make_ws(c, k_max=k + 3)
    out = torch.full_like(c.q, float("nan"))
    _, sel = ds_launch.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(budgets(c, k), k, mode), ws=ws, out=out,
                                 num_splits=3, num_progs=2, return_sel=True)
    assert not out.isnan().any()
    _check_selection(c, ws, sel, k, mode)
    assert rel_err(out, _expected_output(c, sel, k, mode)) < TOL[torch.bfloat16]


# Budgets per request inside one batch (B = 5, 9 query / 3 KV heads, lengths off every block size):
# a sparse request, one shorter than its k (dense), one marked DENSE, one with k = seq_len - 1, and
# a small k; no k a multiple of a block. Sink and recent positions are forced.
BUDGET_LENS = [203, 37, 150, 90, 61]
BUDGET_KS = [45, 50, DENSE, 89, 13]
BUDGET_RUNS = [  # mode, labels, tuning overrides, split-K partitions (None: the launcher's)
    ("per_head", torch.bfloat16, {"score_impl": "mma"}, 5),
    ("group_sum", torch.bfloat16, {"score_impl": "rows", "score_loop_stages": 2}, None),
    ("group_max", torch.bfloat16, {"score_impl": "mma"}, 7),
    ("per_head", FP8, {"score_impl": "rows"}, 3),
    ("group_sum", FP8, {"score_impl": "mma", "compact_loop_stages": 2}, 5),
    ("group_max", FP8, {"score_impl": "rows", "select_block_n": 256}, None),
]


@pytest.mark.parametrize("mode,label_dtype,overrides,splits", BUDGET_RUNS,
                         ids=lambda x: str(x).replace("torch.", "") if not isinstance(x, dict) else
                         "-".join(f"{k}={v}" for k, v in x.items()))
def test_ds_decode_per_request_budgets(mode, label_dtype, overrides, splits):
    """Each request selects exactly its own k (the reference's ordered top-k of its scores) and
    attends to those k tokens; requests not longer than their k decode densely. Splits past a
    short request's k contribute nothing; in the group modes a second call with other budgets
    on the same workspace is as exact (per_head runs one: 9 rows per request are slow under the
    interpreter)."""
    c = make_case(BUDGET_LENS, 9, 3, 64, r=16, label_dtype=label_dtype, device=DEVICE,
                  seed=_seed("budgets", mode, str(label_dtype)))
    tuning = KernelTuning.from_dict(overrides)
    ws = make_ws(c, k_max=150)
    runs = [(BUDGET_KS, 89), ([13, 36, 149, DENSE, 60], 149)]
    for ks, k_max in runs[:1] if mode == "per_head" else runs:
        ks = torch.tensor(ks, dtype=torch.int32, device=DEVICE)
        out = torch.full_like(c.q, float("nan"))
        _, sel = ds_launch.ds_decode(*c.args(), c.sm_scale,
                                     DSDecodeArgs(ks, k_max, mode, num_sink=2, num_recent=3, tuning=tuning), ws=ws,
                                     out=out, num_splits=splits, num_progs=2, return_sel=True)
        assert not out.isnan().any()
        _check_selection(c, ws, sel, ks, mode, num_sink=2, num_recent=3)
        for b, k in enumerate(ks.tolist()):
            if int(c.seq_lens[b]) > k:  # the forced positions are among the k
                n = int(c.seq_lens[b])
                assert all({0, 1, n - 3, n - 2, n - 1} <= set(row[:k].tolist()) for row in sel[b, :rows_of(mode, 9, 3)])
        assert rel_err(out, _expected_output(c, sel, ks, mode)) < TOL[torch.bfloat16]
        dense_rows = [b for b, k in enumerate(ks.tolist()) if int(c.seq_lens[b]) <= k]
        dense = ref.dense_decode_ref(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_idx, c.seq_lens, c.sm_scale)
        assert rel_err(out[dense_rows], dense[dense_rows]) < TOL[torch.bfloat16]
    assert int(ws.hist[0].abs().sum()) == 0


def test_ds_decode_budgets_match_one_request_at_a_time():
    """A batch of different budgets gives each request the selection and output it gets alone
    with its own k (one budget per call, the old single-k behaviour)."""
    c = make_case([130, 77, 201], 9, 3, 64, device=DEVICE, seed=17)
    ks = torch.tensor([33, 76, 7], dtype=torch.int32, device=DEVICE)
    ws = make_ws(c, k_max=80)
    out, sel = ds_launch.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(ks, 76, "group_max"), ws=ws, num_splits=4,
                                   return_sel=True)
    out, sel = out.clone(), sel.clone()
    for b in range(3):
        args = list(c.args())
        args[0], args[7], args[8] = c.q[b: b + 1], c.req_idx[b: b + 1], c.seq_lens[b: b + 1]
        k = int(ks[b])
        o1, s1 = ds_launch.ds_decode(*args, c.sm_scale, DSDecodeArgs(ks[b: b + 1], k, "group_max"), ws=ws.rows(0, 1),
                                     num_splits=4, return_sel=True)
        assert torch.equal(s1[0, :3, :k], sel[b, :3, :k])
        assert rel_err(o1[0], out[b]) < 1e-2


PIPELINES = [
    {"score_impl": "rows"},
    {"score_impl": "rows", "score_loop_stages": 3, "select_loop_stages": 2, "select_block_n": 128},
    {"score_impl": "rows", "score_loop_stages": 2},
    {"score_impl": "mma", "mma_block_n": 32},
    {"score_impl": "mma", "select_block_n": 256},
    {"score_impl": "mma", "mma_block_n": 16},
    {"score_impl": "mma", "compact_loop_stages": 2},
    # the CUDA score (GPU only): histogram in the score launch, or the select's phase 1
    {"score_impl": "cuda"},
    {"score_impl": "cuda", "score_cuda_hist": False, "select_impl": "triton"},
    {"score_impl": "cuda", "score_cuda_rows_per_thread": 1, "score_cuda_programs_per_sm": 5},
]


@pytest.mark.parametrize("tuning", PIPELINES, ids=lambda t: "-".join(f"{k}={v}" for k, v in t.items()))
@pytest.mark.parametrize("mode", ["per_head", "group_max"])
def test_ds_select_pipelines(tuning, mode):
    """Every KernelTuning choice of how the top-k is computed gives the same exact selection,
    over repeated calls on one workspace (the histograms are left clean)."""
    if tuning.get("score_impl") == "cuda" and DEVICE == "cpu":
        pytest.skip("the CUDA score needs a GPU")
    if DEVICE == "cpu" and mode == "per_head" and tuning not in (PIPELINES[0], PIPELINES[3]):
        pytest.skip("interpreter time: per_head runs one rows and one mma pipeline on the CPU")
    _check_pipeline(tuning, mode, 9, 3)


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA kernels need a GPU")
@pytest.mark.parametrize("tuning", [{"score_cuda_tc_tiles": 1}, {"score_cuda_tc_tiles": 4, "score_cuda_hist": False},
                                    {"score_cuda_tc_tiles": 8, "score_cuda_programs_per_sm": 5}], ids=str)
@pytest.mark.parametrize("heads", [(32, 8), (28, 4), (8, 8), (16, 8), (32, 32)], ids=str)
@pytest.mark.parametrize("mode", ["per_head", "group_sum", "group_max"])
def test_ds_select_tensor_core_score(tuning, heads, mode):
    """The tensor-core score (score_tc.cu: Llama-3's 32/8 heads, Qwen2.5-7B's 28/4, MHA with 8 and
    32 heads, G = 2) in the whole DS decode: the exact top-k of its scores, and the output over
    them."""
    from doublesparse.kernels.cuda import score as cuda_score
    c = make_case([20], heads[0], heads[1], 64, r=16, device=DEVICE, seed=1)
    assert cuda_score.tc_fits(c.q, c.label_cache)
    _check_pipeline({"score_impl": "cuda", "score_cuda_tc": True, **tuning}, mode, *heads)


def _check_pipeline(overrides, mode, hq, hkv):
    tuning = KernelTuning.from_dict(overrides)
    ws = None
    for i, (seq_lens, k) in enumerate([([300, 41, 517], 40), ([129, 260], 64)]):
        c = make_case(seq_lens, hq, hkv, 64, r=16, device=DEVICE, seed=_seed(i, mode, str(overrides)), max_ctx=520)
        ws = ws or make_ws(c, k_max=64)
        out = torch.full_like(c.q, float("nan"))
        _, sel = ds_launch.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(budgets(c, k), k, mode, tuning=tuning), ws=ws,
                                     out=out, num_progs=2, return_sel=True)
        _check_selection(c, ws, sel, k, mode)
        assert rel_err(out, _expected_output(c, sel, k, mode)) < TOL[torch.bfloat16]
    assert int(ws.hist[0].abs().sum()) == 0  # phase 3 clears it; phase 2 overwrites hist[1:]


def test_ds_select_all_ties():
    """Equal scores everywhere (a zero query): any k distinct positions are a top-k."""
    c = make_case([400, 150], 9, 3, 64, device=DEVICE, seed=3)
    c.q.zero_()
    k = 24
    ws = make_ws(c, k_max=k)
    _, sel = ds_launch.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(budgets(c, k), k, "group_max"), ws=ws, num_progs=2,
                                 return_sel=True)
    _check_selection(c, ws, sel, k, "group_max")


def test_ds_select_more_programs_than_phase_cap():
    """Asked for more programs per row than workspace.SELECT_MAX_PROGS, phases 2 and 3 run with
    that many and the selection is still the ordered top-k."""
    from doublesparse.kernels.workspace import SELECT_MAX_PROGS
    tuning = KernelTuning(select_block_n=16, hist_block_n=16)
    c = make_case([700, 333], 9, 3, 64, device=DEVICE, seed=41)
    ws = make_ws(c, k_max=50)
    _, sel = ds_launch.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(budgets(c, 50), 50, "group_max", tuning=tuning),
                                 ws=ws, num_progs=SELECT_MAX_PROGS + 5, return_sel=True)
    _check_selection(c, ws, sel, 50, "group_max")


def test_ds_repeated_calls_keep_workspace_clean():
    """Histograms are cleared by the kernels themselves: many calls on one workspace stay exact."""
    ws = None
    for i, seq_lens in enumerate([[200, 90], [150, 300], [61, 62]]):
        c = make_case(seq_lens, 9, 3, 64, device=DEVICE, seed=100 + i, max_ctx=300)
        ws = ws or make_ws(c, k_max=60)
        _, sel = ds_launch.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(budgets(c, 60), 60, "group_max"), ws=ws,
                                     num_progs=3, return_sel=True)
        _check_selection(c, ws, sel, 60, "group_max")
    assert int(ws.hist[0].abs().sum()) == 0


def test_ds_decode_on_workspace_rows_matches_whole_batch():
    """Parts of a batch on disjoint workspace rows (``ws.rows``) give the whole call's selection
    and, up to split-K rounding, its output: the parts share no scratch."""
    c = make_case([300, 90, 257], 9, 3, 64, device=DEVICE, seed=21)
    k = 40
    ws = make_ws(c, k_max=k)
    whole, sel = ds_launch.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(budgets(c, k), k, "group_max"), ws=ws,
                                     return_sel=True)
    sel = sel.clone()
    out = torch.full_like(c.q, float("nan"))
    for a, b in ((0, 1), (1, 3)):
        args = list(c.args())
        args[0], args[7], args[8] = c.q[a:b], c.req_idx[a:b], c.seq_lens[a:b]
        _, part_sel = ds_launch.ds_decode(*args, c.sm_scale, DSDecodeArgs(budgets(c, k)[a:b], k, "group_max"),
                                          ws=ws.rows(a, b), out=out[a:b], return_sel=True)
        for i in range(b - a):
            for h in range(3):
                n = min(k, int(c.seq_lens[a + i]))
                assert set(part_sel[i, h, :n].tolist()) == set(sel[a + i, h, :n].tolist())
    assert rel_err(out, whole) < TOL[torch.bfloat16]
    assert int(ws.hist[0].abs().sum()) == 0  # phase 3 clears it; phase 2 overwrites hist[1:]
    with pytest.raises(ValueError):
        ws.rows(2, 4)


def test_ds_decode_score_then_rest_matches_all():
    """stage "score" then stage "rest" (how batch parts are skewed across streams) is the whole
    call: same selection, same output; an unknown stage is refused."""
    c = make_case([300, 33, 257], 9, 3, 64, device=DEVICE, seed=23)
    k = 40
    ws = make_ws(c, k_max=k)
    whole, sel = ds_launch.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(budgets(c, k), k, "group_max"), ws=ws,
                                     return_sel=True)
    whole, sel = whole.clone(), sel.clone()
    out = torch.full_like(c.q, float("nan"))
    assert ds_launch.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(budgets(c, k), k, "group_max"), ws=ws, stage="score") is None
    _, sel2 = ds_launch.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(budgets(c, k), k, "group_max"), ws=ws, out=out,
                                  stage="rest", return_sel=True)
    for b in range(3):
        n = min(k, int(c.seq_lens[b]))
        for h in range(3):
            assert set(sel2[b, h, :n].tolist()) == set(sel[b, h, :n].tolist())
    assert rel_err(out, whole) < TOL[torch.bfloat16]
    with pytest.raises(ValueError):
        ds_launch.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(budgets(c, k), k, "group_max"), ws=ws, stage="scores")


def test_ds_dense_budget_and_sink_recent():
    c = make_case([100, 400, 250], 9, 3, 64, device=DEVICE, seed=11)
    k = 48
    ks = budgets(c, k, dense_below=260)  # the 250-token request carries DENSE
    ws = make_ws(c, k_max=k)
    out, sel = ds_launch.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(ks, k, "group_sum", num_sink=4, num_recent=8),
                                   ws=ws, return_sel=True)
    exp = _expected_output(c, sel, ks, "group_sum")
    assert rel_err(out, exp) < TOL[torch.bfloat16]
    dense = ref.dense_decode_ref(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_idx,
                                 c.seq_lens, c.sm_scale)
    assert rel_err(out[[0, 2]], dense[[0, 2]]) < TOL[torch.bfloat16]
    s = set(sel[1, 0, :k].tolist())
    assert set(range(4)) <= s and set(range(392, 400)) <= s


def test_ds_matches_full_reference_when_k_covers_everything():
    c = make_case([70, 64], 9, 3, 64, device=DEVICE, seed=5)
    ws = make_ws(c, k_max=80)
    out = ops.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(budgets(c, 69), 69, "group_max"), ws=ws, impl="triton")
    exp = ref.ds_decode_ref(*c.args(), c.sm_scale, budgets(c, 69), "group_max")
    assert rel_err(out, exp) < TOL[torch.bfloat16]


@pytest.mark.parametrize("mode", ["per_head", "group_sum", "group_max"])
@pytest.mark.parametrize("label_dtype", [torch.bfloat16, FP8])
def test_ops_torch_path_matches_reference(mode, label_dtype):
    c = make_case([70, 20, 301], 9, 3, 64, seed=9, label_dtype=label_dtype)
    for ks, sink, recent in ((budgets(c, 16), 0, 0), (budgets(c, 16, dense_below=100), 2, 3),
                             (torch.tensor([69, 5, 40], dtype=torch.int32), 2, 3)):  # budgets differ per row
        out = ops.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(ks, 69, mode, sink, recent), impl="torch")
        exp = ref.ds_decode_ref(*c.args(), c.sm_scale, ks, mode, sink, recent)
        assert torch.allclose(out.float(), exp.to(out.dtype).float(), atol=1e-2, rtol=1e-2)
    out = ops.dense_decode(*c.args()[:3], *c.args()[6:], c.sm_scale, impl="torch")
    exp = ref.dense_decode_ref(*c.args()[:3], *c.args()[6:], c.sm_scale)
    assert torch.allclose(out.float(), exp.to(out.dtype).float(), atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------- rope
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 9, 3, 64), (37, 32, 8, 128)])
def test_rope_kernel_matches_torch(t, hq, hkv, d):
    g = torch.Generator().manual_seed(_seed(t, hq, d))
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).bfloat16().to(DEVICE)
    q = qkv[:, : hq * d].view(t, hq, d)                  # strided views, as the model passes them
    k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    pos = torch.randint(0, 500, (t,), generator=g).to(DEVICE)
    ang = torch.arange(512)[:, None].float() * torch.rand(d // 2, generator=g)[None]
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    qo, ko = ops.rope(pos, q, k, cos, sin, impl="triton")
    qe, ke = ops.rope(pos, q, k, cos, sin, impl="torch")
    assert qo.is_contiguous() and ko.is_contiguous()
    torch.testing.assert_close(qo.float(), qe.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(ko.float(), ke.float(), atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------- bad arguments
def test_bad_arguments_raise_value_error():
    c = make_case([40], 9, 3, 64, device=DEVICE, seed=1)
    ws = make_ws(c, k_max=16)
    a = list(c.args())
    with pytest.raises(ValueError, match="k_max must be positive"):
        ds_launch.ds_decode(*a, c.sm_scale, DSDecodeArgs(budgets(c, 0), 0), ws=ws)
    with pytest.raises(ValueError, match="args.k"):
        ds_launch.ds_decode(*a, c.sm_scale, DSDecodeArgs(budgets(c, 8).long(), 8), ws=ws)
    with pytest.raises(ValueError, match="args.k"):
        ds_launch.ds_decode(*a, c.sm_scale, DSDecodeArgs(torch.cat([budgets(c, 8)] * 2), 8), ws=ws)
    with pytest.raises(ValueError, match="exceeds workspace"):
        ds_launch.ds_decode(*a, c.sm_scale, DSDecodeArgs(budgets(c, 17), 17), ws=ws)
    with pytest.raises(ValueError, match="mode"):
        ds_launch.ds_decode(*a, c.sm_scale, DSDecodeArgs(budgets(c, 8), 8, "bogus"), ws=ws)
    with pytest.raises(ValueError, match="seq_lens"):
        ds_launch.ds_decode(*a[:8], c.seq_lens.long(), c.sm_scale, DSDecodeArgs(budgets(c, 8), 8), ws=ws)
    with pytest.raises(ValueError, match="channels"):
        ds_launch.ds_decode(*a[:5], c.channels[:, :4], *a[6:], c.sm_scale, DSDecodeArgs(budgets(c, 8), 8), ws=ws)
    with pytest.raises(ValueError, match="q"):
        launch.dense_decode(c.q.int(), *a[1:3], *a[6:], c.sm_scale, ws)
    with pytest.raises(ValueError, match="dims"):
        launch.dense_decode(c.q[0], *a[1:3], *a[6:], c.sm_scale, ws)
    wide = torch.zeros(c.k_cache.shape[0], 3, 65, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="r=65"):
        ds_launch.ds_decode(c.q, c.k_cache, c.v_cache, wide, c.label_scale,
                            torch.zeros(3, 65, dtype=torch.int32, device=DEVICE), *a[6:], c.sm_scale,
                            DSDecodeArgs(budgets(c, 8), 8), ws=ws)
    with pytest.raises(ValueError, match="label_scale"):
        ds_launch.ds_decode(c.q, c.k_cache, c.v_cache, c.label_cache.to(torch.float8_e4m3fn), None, c.channels, *a[6:],
                            c.sm_scale, DSDecodeArgs(budgets(c, 8), 8), ws=ws)
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match="on cpu"):
            launch.dense_decode(c.q, c.k_cache.cpu(), c.v_cache, *a[6:], c.sm_scale, ws)
    with pytest.raises(ValueError, match="impl"):
        ops.dense_decode(*a[:3], *a[6:], c.sm_scale, ws, impl="fast")


# ---------------------------------------------------------------- CUDA graphs
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", ["per_head", "group_max"])
def test_cuda_graph_capture_and_replay(mode):
    """Capture store + dense + DS decode once; replay with new lengths and contents == eager."""
    c = make_case([600, 600, 600], 9, 3, 64, device=DEVICE, seed=21)
    ws = make_ws(c, k_max=64, poison=False)
    k_new = torch.randn(3, 3, 64, device=DEVICE).bfloat16()
    slots = c.req_to_token[c.req_idx.long(), 0].clone()
    out_ds, out_dense = torch.empty_like(c.q), torch.empty_like(c.q)
    ks = torch.full_like(c.seq_lens, 64)  # a static buffer, as seq_lens: new budgets per replay

    def step():
        ops.store_kv(c.k_cache, c.v_cache, k_new, k_new, slots, c.label_cache, c.label_scale, c.channels)
        ops.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(ks, 64, mode), ws=ws, out=out_ds)
        ops.dense_decode(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_idx, c.seq_lens,
                         c.sm_scale, ws, out=out_dense)

    c.seq_lens.copy_(torch.tensor([500, 30, 64], dtype=torch.int32))
    graph = capture_graph(step)
    # per replay: one k, then k differing per request (one DENSE, one = seq_len - 1, one small)
    for lens, budget in zip(GRAPH_REPLAY_LENS, ([64, 64, 64], [63, 64, DENSE], [1, 2, 37])):
        c.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        ks.copy_(torch.tensor(budget, dtype=torch.int32))
        c.q.normal_()
        k_new.normal_()
        graph.replay()
        got_ds, got_dense = out_ds.clone(), out_dense.clone()
        step()
        torch.testing.assert_close(got_dense, out_dense, rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(got_ds, out_ds, rtol=2e-2, atol=2e-3)
        assert rel_err(got_ds, _expected_output(c, ws.sel, ks, mode)) < TOL[torch.bfloat16]
        exp = ref.dense_decode_ref(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_idx,
                                   c.seq_lens, c.sm_scale)
        assert rel_err(got_dense, exp) < TOL[torch.bfloat16]


# ---------------------------------------------------------------- the CUDA kernels (kernels/cuda)
_SCORE_DEFINES = [  # score.cu's compile-time values: Llama-3.1-8B r16/r32, fp8, SmolLM2 per head, MHA
    dict(HKV=8, G=4, R=16, MODE=2, LABEL=0, QTYPE=0, CH64=0, DO_HIST=1, LPT=4, MINB=2),
    dict(HKV=8, G=4, R=32, MODE=1, LABEL=0, QTYPE=0, CH64=1, DO_HIST=1, LPT=1, MINB=2),
    dict(HKV=8, G=4, R=16, MODE=2, LABEL=2, QTYPE=1, CH64=0, DO_HIST=1, LPT=2, MINB=2),
    dict(HKV=3, G=3, R=8, MODE=0, LABEL=1, QTYPE=2, CH64=0, DO_HIST=1, LPT=2, MINB=2),
    dict(HKV=32, G=1, R=16, MODE=2, LABEL=0, QTYPE=0, CH64=0, DO_HIST=0, LPT=2, MINB=2),
]


_SCORE_TC_DEFINES = [  # score_tc.cu's: Llama-3.1-8B r16 / r32 (two heads per warp) in bf16, fp16 and fp8
    # (rings of 2, 3, 4 and 8 steps), Qwen2.5-7B r32 per head, MHA with 8, 4 (a ring of 4) or 1
    # heads per warp, G = 2 with 4 heads per warp
    dict(HKV=8, G=4, R=16, MODE=2, LABEL=0, QTYPE=0, CH64=0, DO_HIST=1, LT=4, MINB=2, HPW=2),
    dict(HKV=8, G=4, R=16, MODE=2, LABEL=0, QTYPE=0, CH64=0, DO_HIST=1, LT=2, MINB=2, HPW=2, DEPTH=4),
    dict(HKV=8, G=4, R=16, MODE=2, LABEL=0, QTYPE=0, CH64=0, DO_HIST=1, LT=1, MINB=2, HPW=2, DEPTH=8),
    dict(HKV=8, G=4, R=16, MODE=2, LABEL=2, QTYPE=0, CH64=0, DO_HIST=1, LT=4, MINB=2, HPW=2, DEPTH=3),
    dict(HKV=8, G=4, R=32, MODE=1, LABEL=0, QTYPE=0, CH64=1, DO_HIST=1, LT=2, MINB=2, HPW=2),
    dict(HKV=8, G=4, R=16, MODE=0, LABEL=1, QTYPE=0, CH64=0, DO_HIST=1, LT=2, MINB=3, HPW=2),
    dict(HKV=8, G=4, R=16, MODE=2, LABEL=2, QTYPE=0, CH64=0, DO_HIST=1, LT=6, MINB=2, HPW=2),
    dict(HKV=4, G=7, R=32, MODE=0, LABEL=2, QTYPE=1, CH64=0, DO_HIST=1, LT=4, MINB=2),
    dict(HKV=8, G=1, R=16, MODE=2, LABEL=0, QTYPE=2, CH64=0, DO_HIST=0, LT=4, MINB=3),
    dict(HKV=32, G=1, R=16, MODE=2, LABEL=0, QTYPE=0, CH64=0, DO_HIST=1, LT=1, MINB=2, HPW=8),
    dict(HKV=32, G=1, R=16, MODE=2, LABEL=0, QTYPE=0, CH64=0, DO_HIST=1, LT=1, MINB=2, HPW=4, DEPTH=4),
    dict(HKV=8, G=2, R=16, MODE=1, LABEL=2, QTYPE=0, CH64=0, DO_HIST=1, LT=4, MINB=2, HPW=4),
]


@pytest.mark.parametrize("source,defines", [("select.cu", {})] + [("score.cu", d) for d in _SCORE_DEFINES]
                         + [("score_tc.cu", d) for d in _SCORE_TC_DEFINES])
def test_cuda_source_compiles(tmp_path, source, defines):
    """The CUDA C++ sources compile for sm_90 without spilling registers (nvcc where the machine
    has it; on a GPU, NVRTC compiles them at run time and the tests below run them)."""
    import shutil
    import subprocess
    from doublesparse.kernels.cuda import nvrtc
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    res = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                          *[f"-D{k}={v}" for k, v in defines.items()], str(nvrtc.source(source))],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert " 0 bytes spill stores" in res.stderr, res.stderr


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA kernels need a GPU")
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["per_head", "group_max"])
def test_cuda_select_equals_triton(case, mode):
    """The CUDA and the Triton select write the same selection, position for position, and the
    CUDA one the ordered top-k of the reference scores."""
    from doublesparse.kernels.cuda import select as cuda_select
    assert cuda_select.unavailable(torch.device(DEVICE)) is None
    seq_lens, hq, hkv, d, r, k = case
    c = make_case(seq_lens, hq, hkv, d, r=r, device=DEVICE, seed=_seed(tuple(seq_lens), mode, "cuda"))
    got = {}
    for impl in ("triton", "cuda"):
        ws = make_ws(c, k_max=k + 3)
        _, sel = ds_launch.ds_decode(*c.args(), c.sm_scale,
                                     DSDecodeArgs(budgets(c, k), k, mode, tuning=KernelTuning(select_impl=impl)), ws=ws,
                                     num_progs=3, return_sel=True)
        if impl == "cuda":
            _check_selection(c, ws, sel, k, mode)
        got[impl] = (sel.clone(), ws.sel_slot.clone())
    assert torch.equal(got["triton"][0], got["cuda"][0]) and torch.equal(got["triton"][1], got["cuda"][1])


def test_cuda_select_launch_protocol(monkeypatch):
    """ds_decode's select stage, when it takes the CUDA kernels (launches recorded here, so this
    runs on the CPU): phases 2 and 3 on one grid, at most SELECT_MAX_PROGS programs per row,
    phase 1 only for stage "hist", and none when the score launch made the histogram."""
    from doublesparse.kernels.workspace import SELECT_MAX_PROGS, DecodeWorkspace
    calls = []
    for name in ("hist_high", "hist_low", "compact"):
        monkeypatch.setattr(ds_launch.cuda_select, name, lambda *a, name=name: calls.append((name, a[-3:])))
    monkeypatch.setattr(ds_launch, "_use_cuda_select", lambda scores, tuning: True)
    monkeypatch.setattr(ds_launch, "num_sms", lambda dev: 132)
    ws = DecodeWorkspace(17, 9, 3, 64, 65536, 64, device="cpu")
    sl = torch.zeros(17, dtype=torch.int32)
    rt = torch.zeros(17, 8, dtype=torch.int32)
    for skip, stage, want in ((False, "all", ["hist_high", "hist_low", "compact"]), (False, "hist", ["hist_high"]),
                              (True, "all", ["hist_low", "compact"])):
        calls.clear()
        ds_launch._select(ws, sl, rt, sl, DSDecodeArgs(sl, 64, tuning=KernelTuning()), 17, 3, skip, None, stage)
        assert [c[0] for c in calls] == want
        grids = {n: g for n, g in calls}
        assert all(g[:2] == (17, 3) for g in grids.values())
        if "compact" in grids:
            assert grids["hist_low"] == grids["compact"] and 1 <= grids["compact"][2] <= SELECT_MAX_PROGS


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA kernels need a GPU")
@pytest.mark.parametrize("case", CASES + [([77, 300, 325], 28, 4, 128, 16, 64)])  # G = 7 (Qwen2.5-7B)
@pytest.mark.parametrize("mode", ["per_head", "group_sum", "group_max"])
@pytest.mark.parametrize("label_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("tc,depth,max_hpw", [(False, 2, 8), (True, 2, 8), (True, 3, 8), (True, 8, 8), (True, 3, 4)],
                         ids=["score.cu", "score_tc.cu", "score_tc.cu-depth3", "score_tc.cu-depth8",
                              "score_tc.cu-depth3-hpw4"])
def test_cuda_score_equals_triton(case, mode, label_dtype, tc, depth, max_hpw):
    """score.cu's (or score_tc.cu's, with a ring of ``depth`` steps and at most ``max_hpw`` KV
    heads per warp) fp16 scores equal the Triton score's within one fp16 rounding step, on the
    sparse requests' positions only, and its fused histogram is that of its own scores' keys."""
    from doublesparse.kernels.cuda import score as cuda_score
    seq_lens, hq, hkv, d, r, k = case
    c = make_case(seq_lens, hq, hkv, d, r=r, label_dtype=label_dtype, device=DEVICE,
                  seed=_seed(tuple(seq_lens), mode, str(label_dtype), "score"))
    if tc and not cuda_score.tc_fits(c.q, c.label_cache, max_hpw):
        pytest.skip("score_tc.cu does not take these shapes")
    base = KernelTuning(score_cuda_tc=tc, score_cuda_tc_depth=depth, score_cuda_tc_max_heads_per_warp=max_hpw)
    per = base.score_cuda_tc_tiles if tc else base.score_cuda_rows_per_thread
    minb = base.score_cuda_min_blocks
    hist = cuda_score.hist_fits(hq, hkv, r, mode)
    why = cuda_score.why_not(c.q, c.label_cache, c.channels, mode, hist, per, minb, tc, depth, max_hpw)
    if why is not None:
        pytest.skip(why)
    rows = rows_of(mode, hq, hkv)
    got = {}
    for impl in ("mma", "cuda"):
        ws = make_ws(c, k_max=k + 3)
        ds_launch.ds_decode(*c.args(), c.sm_scale,
                            DSDecodeArgs(budgets(c, k), k, mode, tuning=base.replace(score_impl=impl)), ws=ws,
                            num_progs=3, stage="score")
        got[impl] = (ws.scores[:, :rows].clone(), ws.hist[0, :, :rows].clone())
    sparse = ref.is_sparse(c.seq_lens.cpu(), budgets(c, k))
    for b in range(c.q.shape[0]):
        n = int(c.seq_lens[b]) if sparse[b] else 0
        a, e = got["cuda"][0][b, :, :n].float(), got["mma"][0][b, :, :n].float()
        # one fp16 step of the larger magnitude (the two round differently), and the Triton
        # score's split of q into two bf16 parts (about 2^-16 of the row's largest score)
        step = torch.maximum(a.abs(), e.abs()).clamp_min(2.0**-14) * 2.0**-10
        tol = step * 1.01 + (e.abs().amax(-1, keepdim=True) * 2e-4 if n else 0)
        assert bool(((a - e).abs() <= tol).all()), (a - e).abs().max()
        if not hist:  # the select's phase 1 makes it, after stage "score"
            continue
        bits = got["cuda"][0][b, :, :n].view(torch.int16).to(torch.int32)
        keys = torch.where(bits < 0, ~bits, bits | 0x8000) & 0xFFFF
        want = torch.zeros(rows, 256, dtype=torch.long, device=DEVICE)  # stays zero for a dense request
        for i, row in enumerate(keys):
            want[i] += torch.bincount(row >> 8, minlength=256)
        assert torch.equal(got["cuda"][1][b].long(), want)


def test_cuda_score_launch_protocol(monkeypatch):
    """ds_decode with the CUDA score (launches recorded here, so this runs on the CPU): one launch
    on a (B, P) grid, and the select then skips its first phase if the score made the histogram,
    not otherwise."""
    calls = []
    monkeypatch.setattr(ds_launch.cuda_score, "score", lambda *a: calls.append(("score", a[-7:])))
    monkeypatch.setattr(ds_launch, "_select", lambda ws, sl, rt, ri, args, B, rows, skip, np, stage:
                        calls.append(("select", skip)))
    monkeypatch.setattr(ds_launch, "_take_cuda", lambda knob, impl, why_not: knob == "score_impl")
    monkeypatch.setattr(ds_launch, "num_sms", lambda dev: 132)
    c = make_case([70, 20, 301], 9, 3, 64, seed=5)
    for hist in (True, False):
        tuning = KernelTuning(score_cuda_hist=hist)
        calls.clear()
        ws = make_ws(c, k_max=16)
        ds_launch.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(budgets(c, 16), 16, "group_max", tuning=tuning), ws=ws,
                            stage="select")
        assert [n for n, _ in calls] == ["score", "select"]
        P, do_hist, per, minb, tc, _depth, _max_hpw = calls[0][1]
        assert do_hist == hist and calls[1][1] == hist and P >= 1
        # 3 KV heads do not divide a block's 8 warps: score.cu, not score_tc.cu
        assert (per, minb, tc) == (tuning.score_cuda_rows_per_thread, tuning.score_cuda_min_blocks, False)


def test_score_impl_choice(monkeypatch):
    """score_impl: an unknown value is a clear error; "cuda" where the CUDA score cannot run warns
    once and scores with Triton (the interpreter stands in for a GPU here)."""
    import warnings
    c = make_case([70, 20, 301], 9, 3, 64, seed=6, device=DEVICE)
    ws = make_ws(c, k_max=16)
    with pytest.raises(ValueError, match="score_impl"):
        KernelTuning(score_impl="fast")
    tuning = KernelTuning(score_impl="cuda")
    monkeypatch.setattr(ds_launch, "INTERPRET", False)
    monkeypatch.setattr(ds_launch, "_WARNED", set())
    monkeypatch.setattr(ds_launch.cuda_score, "why_not", lambda *a: "a test reason")
    used = []
    monkeypatch.setattr(ds_launch, "_score_mma", lambda *a, **kw: used.append("mma"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            ds_launch.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(budgets(c, 16), 16, "group_max", tuning=tuning),
                                ws=ws, stage="score")
    msgs = [str(w.message) for w in caught if "score_impl" in str(w.message)]
    assert len(msgs) == 1 and "a test reason" in msgs[0] and used == ["mma", "mma"]
