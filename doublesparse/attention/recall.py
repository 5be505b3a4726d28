"""Sampled attention recall: how much of the exact attention mass the live selection captures.

Every ``interval``-th sparse decode step, one layer (rotating over the layers) and at most ``rows``
of the step's sparse requests (rotating over the batch) are measured: the exact softmax weights of
the sampled rows' queries over each request's whole context, the share of that mass on the tokens
the step selected (per query head, averaged over heads: the recall), and the relative error
``||o_sparse - o_exact|| / ||o_exact||`` of the layer's output for that request.

How it stays off the decode path:

* :meth:`RecallProbe.attach` wraps the backend's ``decode_attention`` (no branch in the backend)
  and the runner's ``decode`` (a host counter decides whether a step is sampled).
* After each layer's sparse decode of a sampled step the wrapper keeps the sampled rows' q,
  output and selection; on a step that is not sampled it launches nothing. On the Triton path
  that is one launch of ``kernels/triton/recall_stash.py``, which does its work only where a
  device control word names the layer (the host arms it with an async copy on sampled steps).
  Eagerly it is launched at the armed layer only. The CUDA graphs cannot branch on the host, so
  the runner captures each sparse bucket twice (engine/model_runner.py): with the stash launched
  after every layer (the control word picks the one at replay) and without; the host, which
  knows from its step counter whether a step is sampled before launching it, replays the first
  on sampled steps only. On the PyTorch path (CPU) the host
  knows the armed layer and copies q and the output; the selection is computed again with
  ``torch_ops.select``, the function that decode itself selects with (same inputs, same tokens).
* After a sampled step the exact attention runs as ordinary launches whose shapes come from
  lengths the host knows: on the Triton path two calls of the decode kernels
  (``ops.attention_lse``: over the rows' whole caches and over their selections), a head's recall
  being ``exp(lse_selection - lse_all)``; on the PyTorch path :func:`exact_recall`. The per-row
  results go to the host by an async copy
  (``transfer.to_host_async``); :meth:`RecallProbe.collect` folds the copies that have landed
  (an event query, never a wait), at stats time. No step ever waits for the device.

Work per sampled step: one layer, ``rows`` requests: a read of their K and V (what a dense decode
of one layer reads for them), plus ``num_layers`` stash launches that return at once but one;
so the average cost per step is about ``rows / (interval * B * num_layers)`` of a dense decode's
plus ``num_layers / interval`` tiny launches. A step that is not sampled costs a host counter.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass

import torch

from ..kernels import parts, torch_ops
from ..kernels.reference import is_fp8_kv
from ..kernels.transfer import to_host_async
from .budget import DENSE
from .recall_stats import RecallStats


@dataclass(frozen=True)
class RecallConfig:
    """interval: every interval-th sparse decode step is sampled (0: off); rows: the most requests
    sampled per sampled step; layer_groups: the histogram's groups of consecutive layers."""

    interval: int = 64
    rows: int = 4
    layer_groups: int = 4

    def __post_init__(self):
        if self.interval < 0 or self.rows < 1 or self.layer_groups < 1:
            raise ValueError(f"recall sampling needs interval >= 0, rows >= 1, layer_groups >= 1; got "
                             f"{self.interval}, {self.rows}, {self.layer_groups}")


def exact_recall(q, out, sel, valid, k_cache, v_cache, slots, sm_scale: float, k_scale=None, v_scale=None):
    """One request's recall and output error at one layer.

    q, out: [Hq, D] (the step's query and sparse output); sel: [R, k] int cache slots selected
    (R = Hq per head, else Hkv); valid: [R, k] bool (the entries attended to) or None (all);
    k_cache, v_cache: [S, Hkv, D]; slots: [n] int64 the request's cache slots, positions 0..n-1.
    Returns ``(recall [Hq] float32, rel_error 0-dim float32)``: per query head the exact softmax
    mass on its row's selected tokens; the Frobenius relative error of ``out``. k_scale, v_scale:
    [1] float32 of an fp8 pool (multiplied on the device: no host sync), else None."""
    Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G, R = Hq // Hkv, sel.shape[0]
    qf = q.float()
    K = k_cache.index_select(0, slots).float()                                  # [n, Hkv, D]
    V = v_cache.index_select(0, slots).float()
    if k_scale is not None:
        K, V = K * k_scale, V * v_scale
    s = torch.matmul(qf.view(Hkv, G, D), K.permute(1, 2, 0)).mul_(sm_scale)   # [Hkv, G, n]
    lse = torch.logsumexp(s, -1)                                               # [Hkv, G]
    o = torch.matmul((s - lse[..., None]).exp_(), V.transpose(0, 1)).reshape(Hq, D)
    heads = torch.arange(R, device=q.device) // (G if R == Hq else 1)
    flat = (sel.long() * Hkv + heads[:, None]).view(-1)
    ksel = k_cache.view(-1, D).index_select(0, flat).view(R, -1, D).float()    # [R, k, D]
    if k_scale is not None:
        ksel = ksel * k_scale
    ssel = torch.matmul(qf.view(R, Hq // R, D), ksel.transpose(1, 2)).mul_(sm_scale)
    w = (ssel - lse.reshape(R, Hq // R)[..., None]).exp_()                     # [R, Hq/R, k]
    if valid is not None:
        w = w * valid[:, None, :]
    recall = w.sum(-1).reshape(Hq).clamp_(max=1.0)
    err = torch.linalg.vector_norm(out.float() - o) / torch.linalg.vector_norm(o).clamp_min(1e-30)
    return recall, err


def _sel_rows(mode: str, num_q_heads: int, num_kv_heads: int) -> int:
    """Selection rows a mode keeps per request: one per query head, one for the layer, else one
    per KV head."""
    return {"per_head": num_q_heads, "layer": 1}.get(mode, num_kv_heads)


@dataclass
class _Armed:
    layer: int
    batch_rows: list[int]   # indices into the step's batch
    req_rows: list[int]     # their rows of req_to_token
    lens: list[int]         # their tokens after the step
    ks: list[int]           # their k


class RecallProbe:
    """The sampled recall of one DoubleSparsityBackend (see the module docstring)."""

    def __init__(self, cfg: RecallConfig, backend, num_layers: int):
        self.cfg, self.backend, self.num_layers = cfg, backend, num_layers
        self.stats = RecallStats(num_layers, cfg.layer_groups)
        self.sparse_steps = 0       # sparse decode steps seen
        self.sampled_steps = 0
        self._next_layer = 0
        self._next_row = 0
        self.armed: _Armed | None = None
        self._stash: dict = {}
        # while a CUDA graph of a sampled step is captured: stash after every layer (the step's
        # layer is picked at replay by the device control word)
        self._capture_stash = False
        # (host [N, 2], event, armed, rows whose request finished meanwhile)
        self._pending: collections.deque = collections.deque()
        # (layer, ks of the sparse rows) -> that layer's ks, where the budget differs per layer
        # (attention/adaptive.py); None: every layer attends to the planned k
        self.scale_k = None
        dev = backend.memory.label[0].device
        self.triton = backend.impl == "triton" or (backend.impl == "auto" and dev.type == "cuda")
        if self.triton:
            self._make_buffers(dev)

    def _make_buffers(self, dev) -> None:
        b, n = self.backend, self.cfg.rows
        Hq, D = b.num_q_heads, b.head_dim
        K = b.workspace.k_max if b.workspace is not None else b.ds.k_max
        i32 = dict(dtype=torch.int32, device=dev)
        self._ctl_host = torch.full((1 + n,), -1, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self._ctl = torch.full((1 + n,), -1, **i32)
        self._q = torch.zeros(n, Hq, D, dtype=torch.float32, device=dev)
        self._o = torch.zeros(n, Hq, D, dtype=torch.float32, device=dev)
        self._sel = torch.zeros(n, Hq, K, **i32)
        self._rowk = torch.zeros(n, Hq, **i32)
        self._q_dtype = torch.float32
        # the measurement's own split-K scratch (no Double Sparsity buffers: it reads given slots)
        from ..kernels.workspace import DecodeWorkspace
        Hkv = b.memory.k[0].shape[1]
        self._ws = DecodeWorkspace(n, Hq, Hkv, D, b.workspace.max_ctx, 0, dev, 64) if b.workspace is not None else None

    # ------------------------------------------------------------------------- wiring
    def attach(self, backend, runner=None) -> None:
        """Wrap ``backend.decode_attention`` (before any graph capture: the runner reads
        ``backend.recall_probe`` to capture the sampled steps' graphs) and, when given,
        ``runner.decode``."""
        inner = backend.decode_attention
        backend.recall_probe = self

        def decode_attention(layer_id, q, batch, q_label=None):
            out = inner(layer_id, q, batch, q_label=q_label)
            if batch.ds_sparse:
                self.observe(layer_id, q, out, q_label)
            return out

        backend.decode_attention = decode_attention
        if runner is not None:
            self.attach_runner(runner)

    def attach_runner(self, runner) -> None:
        inner = runner.decode

        def decode(rows, tokens, positions, plan=None):
            if plan is None:
                plan = self.backend.decode_plan([p + 1 for p in positions])
            self.begin_step(rows, positions, plan)
            logits = inner(rows, tokens, positions, plan)
            self.end_step()
            return logits

        runner.decode = decode

    @contextlib.contextmanager
    def capturing(self, with_stash: bool):
        """While the runner captures a decode graph: with the stash after every layer (the graph
        of sampled steps) or without (every other step's)."""
        old, self._capture_stash = self._capture_stash, bool(with_stash)
        try:
            yield
        finally:
            self._capture_stash = old

    # --------------------------------------------------------------------------- step
    def begin_step(self, rows, positions, plan) -> bool:
        """Host only: whether this step is sampled; if so, arm the layer and rows it measures."""
        ks, sparse = plan
        if not self.cfg.interval or not sparse or ks is None:
            return False
        self.sparse_steps += 1
        if self.sparse_steps % self.cfg.interval:
            return False
        cand = [i for i, k in enumerate(ks) if k != DENSE]
        if not cand:
            return False
        layer, self._next_layer = self._next_layer, (self._next_layer + 1) % self.num_layers
        k_max = self.backend.ds.k_max
        kl = {i: min(int(ks[i]), k_max) for i in cand}
        if self.scale_k is not None:
            # rows whose scaled k reaches their length decode densely at this layer: not sampled
            kl = dict(zip(cand, self.scale_k(layer, list(kl.values()))))
            cand = [i for i in cand if kl[i] < int(positions[i]) + 1]
            if not cand:
                return False
        start = self._next_row % len(cand)
        idx = (cand[start:] + cand[:start])[: self.cfg.rows]
        self._next_row += len(idx)
        self.armed = _Armed(layer, idx, [int(rows[i]) for i in idx], [int(positions[i]) + 1 for i in idx],
                            [kl[i] for i in idx])
        self.sampled_steps += 1
        if self.triton:
            h = self._ctl_host
            h.fill_(-1)
            h[0] = layer
            h[1: 1 + len(idx)] = torch.tensor(idx, dtype=torch.int32)
            self._ctl.copy_(h, non_blocking=True)
        return True

    def observe(self, layer_id: int, q, out, q_label=None) -> None:
        """After layer ``layer_id``'s sparse decode: keep the armed rows' q, output (and, on the
        Triton path, selection; on the PyTorch path, ``q_label``, the unrotated q the selection
        read, default q). Launches nothing on a step that is not sampled."""
        a = self.armed
        if not self._capture_stash and (a is None or a.layer != layer_id):
            return
        if self.triton:
            self._q_dtype = q.dtype   # the stash keeps float32 copies; the measurement reads q as decode did
            b, ds = self.backend, self.backend.ds
            ws, mode = b.workspace, ds.mode_of(layer_id)
            R = _sel_rows(mode, b.num_q_heads, b.memory.k[layer_id].shape[1])
            if mode == "layer":  # its one selection row lives in the virtual head's workspace
                ws = ws.layer
            sel, rowk = (ws.topp_slot, ws.row_k) if ds.top_p > 0 else (ws.sel_slot, None)
            parts.recall_stash(self._ctl, q, out, sel, rowk, self._q, self._o, self._sel, self._rowk, layer_id, R)
            return
        if a is None:  # a graph capture: the host copies below cannot be replayed
            return
        idx = torch.tensor(a.batch_rows, device=q.device)
        ql = q if q_label is None else q_label
        self._stash = {"q": q.index_select(0, idx).clone(), "o": out.index_select(0, idx).float(),
                       "ql": ql.index_select(0, idx)}

    def end_step(self) -> None:
        """After a sampled step: launch the exact attention of the kept rows and start copying the
        results to the host; disarm."""
        a, self.armed = self.armed, None
        if a is None:
            return
        if self.triton:
            self._ctl[:1].fill_(-1)
        elif not self._stash:
            return
        res = self.measure(a)
        self._stash = {}
        host, event = to_host_async(res)
        self._pending.append((host, event, a, set()))

    @torch.inference_mode()
    def measure(self, a: _Armed) -> torch.Tensor:
        """[N, 2] float32 on the device: each kept row's recall (mean over query heads) and
        output relative error."""
        if self.triton and self._ws is not None:
            return self._measure_kernels(a)
        b, ds = self.backend, self.backend.ds
        m = b.memory
        mode = ds.mode_of(a.layer)
        kc, vc = m.k[a.layer], m.v[a.layer]
        res = []
        for i, (row, n, k) in enumerate(zip(a.req_rows, a.lens, a.ks)):
            slots = m.req_to_token[row, :n].long()
            if self.triton:
                q, o = self._q[i], self._o[i]
                R = _sel_rows(mode, b.num_q_heads, kc.shape[1])
                sel = self._sel[i, :R, :k]
                if mode == "layer":
                    sel = sel.expand(kc.shape[1], k)
                valid = None
                if ds.top_p > 0:
                    valid = torch.arange(k, device=q.device)[None, :] < self._rowk[i, :R, None]
            else:
                q, o = self._stash["q"][i], self._stash["o"][i]
                # the slots as decode reads them (a view when consecutive), for the same scores
                start, sl = torch_ops.token_rows(m.req_to_token, row, n)
                sel, valid = torch_ops.select(self._stash["ql"][i], m.label[a.layer], m.label_scale[a.layer],
                                              b.channels[a.layer], start, sl, n, k, b.sm_scale, mode,
                                              ds.num_sink, ds.num_recent, ds.top_p, ds.top_p_min_k)
            sc = (m.k_scale[a.layer], m.v_scale[a.layer]) if is_fp8_kv(kc) else (None, None)
            recall, err = exact_recall(q, o, sel, valid, kc, vc, slots, b.sm_scale, *sc)
            res.append(torch.stack([recall.mean(), err]))
        return torch.stack(res)

    def _measure_kernels(self, a: _Armed) -> torch.Tensor:
        """:meth:`measure` on the decode kernels: one exact attention over the kept rows' whole
        caches and one over their selections (ops.attention_lse), each giving every query head's
        log-sum-exp; a head's recall is ``exp(lse_selection - lse_all)``. Reads the rows' K/V once
        each at the kernels' bandwidth, no float32 copies."""
        from ..kernels import ops
        from ..kernels.transfer import to_device
        b, ds, m = self.backend, self.backend.ds, self.backend.memory
        mode = ds.mode_of(a.layer)
        kc, vc = m.k[a.layer], m.v[a.layer]
        N, Hkv, K = len(a.req_rows), kc.shape[1], max(a.ks)
        dev = kc.device
        sc = dict(k_scale=m.k_scale[a.layer], v_scale=m.v_scale[a.layer]) if is_fp8_kv(kc) else {}
        req = to_device(torch.tensor(a.req_rows, dtype=torch.int32), dev)
        lens = to_device(torch.tensor(a.lens, dtype=torch.int32), dev)
        k = to_device(torch.tensor(a.ks, dtype=torch.int32), dev)
        q, o = self._q[:N].to(self._q_dtype), self._o[:N]
        dense, lse_all = ops.attention_lse(q, kc, vc, m.req_to_token, req, lens, b.sm_scale, self._ws,
                                           tuning=b.tuning, **sc)
        R = _sel_rows(mode, b.num_q_heads, Hkv)
        sel = self._sel[:N, :R, :K]
        if mode == "layer":                      # the layer's one row serves every KV head
            sel, R = sel.expand(N, Hkv, K), Hkv
        row_ks = self._rowk[:N, :R] if ds.top_p > 0 else None
        _, lse_sel = ops.attention_lse(q, kc, vc, m.req_to_token, req, lens, b.sm_scale, self._ws, sel=sel, k=k,
                                       row_ks=row_ks, per_head=mode == "per_head", tuning=b.tuning, **sc)
        recall = torch.exp(lse_sel - lse_all).clamp_(max=1.0).mean(-1)                     # [N]
        d = dense.float()
        err = torch.linalg.vector_norm(o - d, dim=(1, 2)) / torch.linalg.vector_norm(d, dim=(1, 2)).clamp_min(1e-30)
        return torch.stack([recall, err], dim=-1)

    # -------------------------------------------------------------------------- host
    def collect(self) -> None:
        """Fold the results whose copies have landed (an event query: never waits)."""
        keep = collections.deque()
        for entry in self._pending:
            host, event, a, dropped = entry
            if event is not None and not event.query():
                keep.append(entry)
                continue
            for row, (recall, err) in zip(a.req_rows, host.tolist()):
                self.stats.add(a.layer, None if row in dropped else row, float(recall), float(err))
        self._pending = keep

    def take_request(self, row: int) -> dict:
        """The samples of the request that held ``row`` (call when it finishes, before the row is
        reused): samples, recall mean and min, output relative error mean. Samples still on their
        way to the host count for the model, not for the request (no waiting)."""
        self.collect()
        for _, _, a, dropped in self._pending:
            if row in a.req_rows:
                dropped.add(row)
        return self.stats.take_row(row)

    @property
    def pending(self) -> int:
        """Sampled steps whose results have not reached the host tallies yet."""
        return len(self._pending)

    def summary(self) -> dict:
        self.collect()
        return {"sample_interval": self.cfg.interval, "sample_rows": self.cfg.rows,
                "sparse_decode_steps": self.sparse_steps, "sampled_steps": self.sampled_steps,
                **self.stats.summary()}
