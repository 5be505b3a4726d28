"""Builders of random pools and batches for the kernel tests (never zeros, slots scattered)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from doublesparse.attention.budget import DENSE
from doublesparse.kernels import reference as ref
from doublesparse.kernels.workspace import DecodeWorkspace


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    label_cache: torch.Tensor
    label_scale: torch.Tensor
    channels: torch.Tensor
    req_to_token: torch.Tensor
    req_idx: torch.Tensor
    seq_lens: torch.Tensor
    sm_scale: float

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.label_cache, self.label_scale, self.channels,
                self.req_to_token, self.req_idx, self.seq_lens)


def make_case(seq_lens, hq, hkv, d, r=16, dtype=torch.bfloat16, label_dtype=torch.bfloat16,
              device="cpu", seed=0, max_ctx=None):
    """Random pools with each request's tokens at scattered slots (slot 0 stays the pad slot)."""
    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    max_ctx = max_ctx or max(seq_lens)
    total = sum(seq_lens)
    S = total + 7                                                    # a few unused slots
    perm = torch.randperm(S - 1, generator=g)[:total] + 1
    max_reqs = B + 2
    req_to_token = torch.zeros(max_reqs, max_ctx, dtype=torch.int32)
    rows = torch.randperm(max_reqs, generator=g)[:B]
    off = 0
    for b, n in enumerate(seq_lens):
        req_to_token[rows[b], :n] = perm[off: off + n].int()
        off += n
    k_cache = torch.randn(S, hkv, d, generator=g)
    v_cache = torch.randn(S, hkv, d, generator=g)
    # A few strong channels make the approximate scores meaningful, as in real post-RoPE K.
    k_cache[:, :, : d // 8] *= 4
    q = torch.randn(B, hq, d, generator=g)
    channels = torch.stack([torch.randperm(d, generator=g)[:r] for _ in range(hkv)]).int()
    label_scale = torch.tensor([0.05], dtype=torch.float32)
    label_cache = torch.empty(S, hkv, r, dtype=label_dtype)
    lab = torch.gather(k_cache, 2, channels.long()[None].expand(S, -1, -1))
    if label_dtype == torch.float8_e4m3fn:
        lab = (lab / label_scale).clamp(-448, 448)
    label_cache.copy_(lab.to(label_dtype))
    k_cache, v_cache, q = k_cache.to(dtype), v_cache.to(dtype), q.to(dtype)
    to = lambda t: t.to(device)
    return Case(to(q), to(k_cache), to(v_cache), to(label_cache), to(label_scale), to(channels),
                to(req_to_token), to(rows.int()), to(torch.tensor(seq_lens, dtype=torch.int32)),
                1.0 / math.sqrt(d))


def make_ws(case: Case, k_max=0, max_splits=8, poison=True, layer_select=False):
    B, hq, d = case.q.shape
    ws = DecodeWorkspace(B, hq, case.k_cache.shape[1], d, case.req_to_token.shape[1],
                         k_max, device=case.q.device, max_splits=max_splits,
                         layer_select=layer_select)
    if poison:
        for w in (ws, ws.layer) if ws.layer is not None else (ws,):
            w.part_o.fill_(float("nan"))
            w.part_lse.fill_(float("nan"))
            if k_max:
                w.scores.fill_(float("nan"))
                w.sel.fill_(-7)
    return ws


def rel_err(out, expect):
    out, expect = out.double(), expect.double()
    return ((out - expect).norm() / expect.norm().clamp_min(1e-12)).item()


TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def rows_of(mode, hq, hkv):
    return hq if mode == "per_head" else 1 if mode == "layer" else hkv


def budgets(c, k, dense_below=0):
    """Per-request budgets ([B] int32 on the case's device) for ops.ds_decode: k everywhere, DENSE
    for requests shorter than ``dense_below``."""
    ks = torch.full_like(c.seq_lens, k)
    return torch.where(c.seq_lens >= dense_below, ks, torch.full_like(ks, DENSE))


def _row_ks(c, ks):
    """ks (an int, or a [B] tensor) as a list of B ints."""
    if isinstance(ks, int):
        return [ks] * c.q.shape[0]
    return [int(x) for x in ks.cpu()]


def check_selection(c, ws, sel, ks, mode, num_sink=0, num_recent=0):
    """Per sparse request (seq_len > its k, ks: an int or [B] budgets): the selected set is the
    top-k of the kernel's fp16 scores in the select's order; scores match the reference (the
    sink and recent positions at fp16's largest value, as the kernels force them)."""
    hq, hkv = c.q.shape[1], c.k_cache.shape[1]
    rows = rows_of(mode, hq, hkv)
    exp_scores = ref.label_scores_ref(c.q, c.label_cache, c.label_scale, c.channels,
                                      c.req_to_token, c.req_idx, c.seq_lens, mode, c.sm_scale)
    exp_scores = ref.force_keep(exp_scores, c.seq_lens, num_sink, num_recent, value=65504.0)
    for b, k in enumerate(_row_ks(c, ks)):
        n = int(c.seq_lens[b])
        if not n > k:
            continue
        got = ws.scores[b, :rows, :n].float()
        assert rel_err(got, exp_scores[b, :, :n]) < 2e-3
        s = sel[b, :rows, :k].long()
        assert bool(((s >= 0) & (s < n)).all()), "selected position out of range"
        assert all(len(set(row.tolist())) == k for row in s.cpu()), "duplicate selection"
        picked = torch.gather(got, 1, s).sort(-1).values
        best = got.topk(k, -1).values.sort(-1).values
        assert torch.equal(picked, best), "selection is not the top-k (beyond ties)"
        assert s.cpu().tolist() == ordered_top_k(ws.scores[b, :rows, :n], k), \
            "selection order differs from the kernel's contract"


def ordered_top_k(scores16, k):
    """The select's contract per row: positions whose 16-bit key is above the k-th largest key,
    in increasing order, then those equal to it, in increasing order, k in all."""
    bits = scores16.cpu().view(torch.int16).to(torch.int32)
    keys = torch.where(bits < 0, ~bits, bits | 0x8000) & 0xFFFF
    rows = []
    for row in keys:
        thr = int(row.topk(k).values[-1])
        above = (row > thr).nonzero().flatten().tolist()
        rows.append(above + (row == thr).nonzero().flatten().tolist()[: k - len(above)])
    return rows


def expected_output(c, sel, ks, mode):
    """The reference output over the kernel's selection: per request (ks: an int or [B] budgets)
    its first k entries of sel where seq_len > k, its whole cache otherwise."""
    rows = rows_of(mode, c.q.shape[1], c.k_cache.shape[1])
    out = ref.dense_decode_ref(c.q, c.k_cache, c.v_cache, c.req_to_token, c.req_idx,
                               c.seq_lens, c.sm_scale)
    for b, k in enumerate(_row_ks(c, ks)):
        if int(c.seq_lens[b]) > k:
            pos = sel[b: b + 1, :rows, :k].long().clamp(0, c.req_to_token.shape[1] - 1)
            out[b] = ref.sparse_decode_ref(c.q[b: b + 1], c.k_cache, c.v_cache, c.req_to_token,
                                           c.req_idx[b: b + 1], pos, c.sm_scale)[0]
    return out


# Lengths the graph tests replay with (the graphs are captured at 600 x 3): long and short
# requests, a request of one token, and one at the pool's end.
GRAPH_REPLAY_LENS = ([600, 65, 1], [64, 599, 300], [2, 3, 600])


def capture_graph(step):
    """A CUDA graph of ``step()``, run once first outside the capture (compiles kernels, builds
    lazy state such as cached tables)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


__all__ = ["Case", "make_case", "make_ws", "rel_err", "TOL", "rows_of", "ref", "budgets", "check_selection",
           "ordered_top_k", "expected_output", "capture_graph", "GRAPH_REPLAY_LENS"]
