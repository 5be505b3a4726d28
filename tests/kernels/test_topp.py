"""The top-p token budget: the batched PyTorch path and the Triton kernels (ds_topp.py) against
the float32 reference (reference.topp_keep_ref), on random inputs with poisoned scratch."""

import pytest
import torch
from conftest import DEVICE
from kernel_utils import TOL, make_case, make_ws, ref, rel_err, rows_of

from doublesparse.attention.budget import DENSE
from doublesparse.kernels import ops
from doublesparse.kernels.ops import DSDecodeArgs
from doublesparse.kernels.triton import ds_launch


def _kept_slots(c, b, positions, keep):
    """Cache slots of the kept selected positions of request b, as a set."""
    rt = c.req_to_token[c.req_idx[b].long()]
    return set(rt[positions[keep].long()].tolist())


@pytest.mark.parametrize("mode,p,k_min", [("per_head", 0.8, 25), ("group_sum", 0.3, 1), ("group_max", 0.95, 0)])
def test_torch_path_matches_reference(mode, p, k_min):
    """Awkward sizes (9/3 heads, a request shorter than its k, one DENSE); several masses and
    lower bounds; top_p = 1 keeps the whole selection, so it equals the fixed budget."""
    c = make_case([211, 6, 97], 9, 3, 64, r=8, dtype=torch.float32, seed=len(mode))
    c.q.mul_(2)
    ks = torch.tensor([40, 40, DENSE], dtype=torch.int32)
    R = rows_of(mode, 9, 3)
    counts = torch.full((3, R), -1, dtype=torch.int32)
    out = ops.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(ks, 40, mode, 2, 3, top_p=p, top_p_min_k=k_min),
                        impl="torch", row_counts=counts)
    exp = ref.ds_decode_ref(*c.args(), c.sm_scale, ks, mode, 2, 3, top_p=p, top_p_min_k=k_min)
    assert rel_err(out, exp) < 1e-5
    assert bool((counts[0] >= max(k_min, 5)).all()) and bool((counts[0] <= 40).all())
    assert counts[1:].tolist() == [[6] * R, [97] * R]   # dense requests: their lengths
    full = ops.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(ks, 40, mode, 2, 3, top_p=1.0), impl="torch")
    fixed = ops.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(ks, 40, mode, 2, 3), impl="torch")
    assert rel_err(full, fixed) < 1e-6


def test_keep_ref_small_example():
    """One row by hand: weights of the unforced tokens 4:2:1:1 (log scores), forced position 0."""
    lg = torch.log(torch.tensor([9.0, 4.0, 2.0, 1.0, 1.0]))
    pos = torch.tensor([0, 1, 2, 3])
    # p = 0.5 of the unforced mass (8): token 1 alone (4) reaches it
    assert ref.topp_keep_ref(lg, pos, 5, 0.5, 0, num_sink=1).tolist() == [True, True, False, False]
    # at least 3 tokens with the forced one
    assert ref.topp_keep_ref(lg, pos, 5, 0.5, 3, num_sink=1).tolist() == [True, True, True, False]
    # p = 0.8 needs 7 of 8: tokens 1, 2 and the ties at weight 1 (3 is selected, 4 is not)
    assert ref.topp_keep_ref(lg, pos, 5, 0.8, 0, num_sink=1).tolist() == [True, True, True, True]


@pytest.mark.parametrize("mode", ["group_max", "per_head"])
def test_triton_matches_reference(mode):
    """Odd batch, 9/3 heads, lengths off every block size, a request shorter than its k, one at
    the workspace's k bound; poisoned scratch. The kept sets are the reference's on the kernel's
    own scores, the counts match row_counts, the output the reference over those tokens."""
    lens = [203, 7, 150] if mode == "group_max" else [71]
    ks_list = [45, 40, 60] if mode == "group_max" else [37]
    c = make_case(lens, 9, 3, 64, r=16, device=DEVICE, seed=7)
    c.q.mul_(3)  # peakier attention than unit-variance noise, so the mass concentrates
    ws = make_ws(c, k_max=60)
    ws.topp_part.fill_(float("nan"))
    ws.row_k.fill_(-5)
    ks = torch.tensor(ks_list, dtype=torch.int32, device=DEVICE)
    R = rows_of(mode, 9, 3)
    p, k_min, sink, recent = 0.9, 12, 2, 3
    out = torch.full_like(c.q, float("nan"))
    args = DSDecodeArgs(ks, 60, mode, sink, recent, top_p=p, top_p_min_k=k_min)
    _, sel = ds_launch.ds_decode(*c.args(), c.sm_scale, args, ws=ws, out=out, num_splits=3,
                                 num_progs=2 if mode == "group_max" else 1, return_sel=True)
    assert not out.isnan().any()
    counts = torch.zeros(len(lens), R, dtype=torch.int32, device=DEVICE)
    ops._fill_row_counts(counts, ws, c.seq_lens, args)
    exp = ref.dense_decode_ref(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_idx, c.seq_lens, c.sm_scale)
    for b, (n, k) in enumerate(zip(lens, ks_list)):
        if n <= k:
            assert counts[b].tolist() == [n] * R
            continue
        keep = torch.stack([ref.topp_keep_ref(ws.scores[b, r, :n].float().cpu(), sel[b, r, :k].cpu(), n, p, k_min,
                                              sink, recent) for r in range(R)])
        for r in range(R):
            got = ws.topp_slot[b, r, : int(counts[b, r])].cpu()
            assert int(counts[b, r]) == int(keep[r].sum()) and k_min <= int(counts[b, r]) <= k
            assert set(got.tolist()) == _kept_slots(c, b, sel[b, r, :k].cpu(), keep[r])
        exp[b] = ref.sparse_decode_ref(c.q[b: b + 1], c.k_cache, c.v_cache, c.req_to_token, c.req_idx[b: b + 1],
                                       sel[b: b + 1, :R, :k].long(), c.sm_scale, keep[None].to(c.q.device))[0]
    assert bool((counts[0] < ks_list[0]).any()), "the budget should cut some row below its k"
    assert rel_err(out, exp) < TOL[torch.bfloat16]


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", ["per_head", "group_max"])
def test_cuda_graph_capture_and_replay(mode):
    """The top-p decode (on the GPU: the CUDA score and select, then the top-p launches) captured
    once, replayed with new lengths, budgets and contents == eager == the reference on the
    kernel's selection; G = 7 as in Qwen2.5."""
    c = make_case([600, 600, 600], 28, 4, 64, device=DEVICE, seed=22)
    ws = make_ws(c, k_max=96, poison=False)
    out = torch.empty_like(c.q)
    ks = torch.full_like(c.seq_lens, 96)
    R = rows_of(mode, 28, 4)

    def step():
        ops.ds_decode(*c.args(), c.sm_scale, DSDecodeArgs(ks, 96, mode, 2, 3, top_p=0.9, top_p_min_k=16), ws=ws,
                      out=out)

    c.seq_lens.copy_(torch.tensor([500, 30, 96], dtype=torch.int32, device=DEVICE))
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens, budget in (([600, 65, 1], [96, 64, 96]), ([64, 599, 300], [63, DENSE, 40])):
        c.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32, device=DEVICE))
        ks.copy_(torch.tensor(budget, dtype=torch.int32, device=DEVICE))
        c.q.normal_().mul_(3)
        graph.replay()
        got, got_k = out.clone(), ws.row_k[:, :R].clone()
        step()
        torch.testing.assert_close(got, out, rtol=2e-2, atol=2e-3)
        assert torch.equal(got_k, ws.row_k[:, :R])
        exp = ref.dense_decode_ref(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_idx, c.seq_lens, c.sm_scale)
        for b, (n, k) in enumerate(zip(lens, budget)):
            if n > k:
                keep = torch.stack([ref.topp_keep_ref(ws.scores[b, r, :n].float().cpu(), ws.sel[b, r, :k].cpu(), n,
                                                      0.9, 16, 2, 3) for r in range(R)])
                assert got_k[b].tolist() == keep.sum(-1).tolist()
                exp[b] = ref.sparse_decode_ref(c.q[b: b + 1], c.k_cache, c.v_cache, c.req_to_token,
                                               c.req_idx[b: b + 1], ws.sel[b: b + 1, :R, :k].long(), c.sm_scale,
                                               keep[None].to(DEVICE))[0]
        assert rel_err(got, exp) < TOL[torch.bfloat16]
