"""Turns scheduler decisions into ForwardBatches, runs the model, replays decode CUDA graphs.

Decode graphs are captured once per batch bucket (1, 2, 4, ... up to ``graph_max_bs``) and, with
Double Sparsity, once more per bucket for steps that decode densely (the backend's ``decode_plan``
says which a step is, from lengths the host knows), with static input buffers; a smaller batch is padded up to its bucket with rows that read and write only the
padding slot 0 through the padding row 0 of req_to_token (seq_len 1), so they cost almost nothing
and touch no real request's cache. With the sampled attention recall (``backend.recall_probe``,
attention/recall.py), each sparse bucket has a second graph with the probe's per-layer stash
launches, replayed on the steps the probe samples (its host counter says which, before the step):
the other steps replay a graph without them. On CPU (or with graphs disabled) everything runs
eagerly.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from ..kernels.tuning import DEFAULT_TUNING, KernelTuning
from ..attention.budget import DENSE
from .cpu_threads import CpuThreads
from ..attention.batch import ForwardBatch
from ..kernels.transfer import to_device


@contextlib.contextmanager
def _cpu_threads(n: int):
    """Run with ``n`` intra-op threads (CPU steps; the choice: engine/cpu_threads.py)."""
    old = torch.get_num_threads()
    if n == old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def graph_buckets(max_bs: int) -> list[int]:
    out, b = [], 1
    while b < max_bs:
        out.append(b)
        b *= 2
    out.append(max_bs)
    return out


class ModelRunner:
    """model: callable ``model(input_ids [T], positions [T], batch) -> logits [N, V] float32``;
    memory: KVMemory; backend: AttentionBackend over that memory; tuning: the kernels' launch
    parameters, handed to the model on every ForwardBatch; cpu_threads: the intra-op threads of
    every CPU step (None: chosen per step from the cores' load, engine/cpu_threads.py)."""

    def __init__(self, model, memory, backend, device, use_cuda_graph: bool = False,
                 graph_max_bs: int = 32, tuning: KernelTuning = DEFAULT_TUNING,
                 cpu_threads: int | None = None):
        self.model = model
        self.tuning = tuning
        self.memory = memory
        self.backend = backend
        self.device = torch.device(device)
        self.graph_max_bs = min(graph_max_bs, memory.plan.max_reqs)
        # (bucket, sparse) -> (graph, static batch, logits, stash): stash is (graph, static batch,
        # logits) of the same step with the recall probe's stash launches (sparse buckets with a
        # probe), else None. The static batches stay referenced: their tensors are the graphs' inputs
        self.graphs: dict[tuple[int, bool], tuple] = {}
        self._inputs = None  # (device buffer, pinned host buffer, its int64 / int32 numpy views, event)
        self.cpu_threads = CpuThreads(cpu_threads) if self.device.type == "cpu" else None
        if use_cuda_graph and self.device.type == "cuda":
            self.capture_graphs()

    # ------------------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def prefill(self, rows: list[int], prefix_lens: list[int], chunks: list[list[int]],
                want_logits: list[bool], all_logits: list[bool] | None = None) -> torch.Tensor:
        """Compute new prompt tokens ``chunks[i]`` of request row ``rows[i]`` at positions
        ``prefix_lens[i] ..``. Returns logits ``[N, V]`` float32, in chunk order: every token's
        of chunk ``i`` when ``all_logits[i]`` (prompt logprobs), else its last token's when
        ``want_logits[i]``, else none."""
        lens = [len(c) for c in chunks]
        T = sum(lens)
        row_t = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), torch.tensor(lens))
        pos = torch.cat([torch.arange(p, p + n, dtype=torch.int64) for p, n in zip(prefix_lens, lens)])
        slots = self.memory.assign(row_t, pos, T)
        ends = torch.tensor(lens).cumsum(0) - 1
        exact: tuple[int, ...] = ()
        if all_logits is None or not any(all_logits):
            idx = ends[torch.tensor(want_logits, dtype=torch.bool)]
        else:
            parts = [torch.arange(e - n + 1, e + 1) if a else torch.tensor([e] if w else [], dtype=torch.int64)
                     for e, n, w, a in zip(ends.tolist(), lens, want_logits, all_logits)]
            idx = torch.cat(parts)
            # every logit of these rows is read: from the LM head's own weight, not a CPU copy
            # rounded to bf16 (exact, and faster for many rows where the CPU lacks bf16 GEMMs)
            starts = torch.tensor([0] + [len(p) for p in parts]).cumsum(0).tolist()
            exact = tuple(j for p, a, s in zip(parts, all_logits, starts) if a for j in range(s, s + len(p)))
        dev = self.device
        batch = ForwardBatch(
            mode="prefill",
            input_ids=to_device(torch.cat([torch.tensor(c, dtype=torch.int64) for c in chunks]), dev),
            positions=to_device(pos, dev), out_slots=to_device(slots, dev),
            req_idx=to_device(torch.tensor(rows, dtype=torch.int32), dev),
            seq_lens=to_device(torch.tensor([p + n for p, n in zip(prefix_lens, lens)], dtype=torch.int32), dev),
            logits_indices=to_device(idx, dev), attn=self.backend, rows_host=tuple(rows),
            extend_prefix_lens=tuple(prefix_lens), extend_lens=tuple(lens), tuning=self.tuning,
            exact_logits_rows=exact)
        self.backend.plan(batch)
        if self.cpu_threads is None:
            return self.model(batch.input_ids, batch.positions, batch)
        with _cpu_threads(self.cpu_threads.prefill(torch.get_num_threads())):
            return self.model(batch.input_ids, batch.positions, batch)

    # ------------------------------------------------------------------------------- decode
    @torch.inference_mode()
    def decode(self, rows: list[int], tokens: list[int], positions: list[int], plan=None) -> torch.Tensor:
        """One token per request: ``tokens[i]`` at ``positions[i]`` (== cached length before the
        step). ``tokens``: host ints, or an int64 ``[B]`` tensor on the device (the engine's
        overlap schedule: the previous step's samples, never read on the host). ``plan``: the
        backend's ``decode_plan`` of this step when the caller has it already. Returns logits
        ``[B, V]`` float32."""
        B = len(rows)
        row_t = torch.tensor(rows, dtype=torch.int64)
        pos_t = torch.tensor(positions, dtype=torch.int64)
        ks, sparse = plan if plan is not None else self.backend.decode_plan([p + 1 for p in positions])
        sampled = self._sampled(sparse)
        bucket = next((b for (b, sp), v in self.graphs.items() if b >= B and sp == sparse
                       and (v[3] is not None or not sampled)), None)
        # a graph replay writes the device req_to_token itself (see _graph_step)
        slots = self.memory.assign(row_t, pos_t, B, write_device=bucket is None)
        if bucket is not None:
            return self._replay_packed((bucket, sparse), B, tokens, positions, slots.numpy(), rows, ks)
        host = self.host_inputs(tokens, pos_t, slots, row_t)
        k = to_device(torch.tensor(ks, dtype=torch.int32), self.device) if ks is not None else None
        if self.cpu_threads is not None:
            n = self.cpu_threads.decode(B, torch.get_num_threads())
            t0 = time.perf_counter()
            with _cpu_threads(n):
                out = self._decode_eager(B, host, tokens, k, sparse)
            self.cpu_threads.record(n, time.perf_counter() - t0)
            return out
        return self._decode_eager(B, host, tokens, k, sparse)

    def _sampled(self, sparse: bool) -> bool:
        """Whether this step is one the recall probe samples (armed by its host counter before
        the step): it replays the graph with the probe's stash launches."""
        probe = getattr(self.backend, "recall_probe", None)
        return sparse and probe is not None and probe.armed is not None

    @staticmethod
    def host_inputs(tokens, pos_t: torch.Tensor, slots: torch.Tensor, row_t: torch.Tensor) -> torch.Tensor:
        """[5, B] int64 on the host: input ids (0 when they are a device tensor, filled in later),
        positions, out slots, request rows, seq lens."""
        ids = torch.zeros_like(pos_t) if isinstance(tokens, torch.Tensor) else torch.tensor(tokens, dtype=torch.int64)
        return torch.stack([ids, pos_t, slots, row_t, pos_t + 1])

    def _device_inputs(self, host: torch.Tensor, tokens) -> torch.Tensor:
        """``host_inputs`` on the device, with the input ids filled in when they are on it."""
        dev = to_device(host, self.device)
        if isinstance(tokens, torch.Tensor):
            dev[0] = tokens
        return dev

    def _decode_eager(self, B: int, host: torch.Tensor, tokens=None, k=None,
                      sparse: bool = False) -> torch.Tensor:
        dev = self._device_inputs(host, tokens)
        batch = ForwardBatch(mode="decode", input_ids=dev[0], positions=dev[1], out_slots=dev[2],
                             req_idx=dev[3].to(torch.int32), seq_lens=dev[4].to(torch.int32),
                             logits_indices=torch.arange(B, device=self.device), attn=self.backend,
                             tuning=self.tuning, k=k, ds_sparse=sparse)
        self.backend.plan(batch)
        return self.model(batch.input_ids, batch.positions, batch)

    # ------------------------------------------------------------------------------- graphs
    def _make_inputs(self) -> None:
        """The graphs' input buffers: rows 0-2 of a [5, n] int64 buffer hold input_ids, positions,
        out_slots; rows 3 and 4 hold req_idx and seq_lens as int32 in their first n int32 lanes
        (the kernels want int32) and row 3's last n lanes each request's k, so one contiguous
        copy moves everything. Padding values: 0 everywhere, seq_len 1 (rows that read and write
        only slot 0), k DENSE."""
        n = self.graph_max_bs
        host = torch.zeros(5, n, dtype=torch.int64, pin_memory=True)
        h64 = host.numpy()
        h32 = h64[3:].view(np.int32)[:, :n]       # [2, n] int32 views of rows 3, 4
        h32[1] = 1
        h64[3].view(np.int32)[n:] = DENSE
        dev = host.to(self.device)
        self._inputs = (dev, host, h64, h32, torch.cuda.Event())

    def _static_batch(self, bs: int, sparse: bool) -> ForwardBatch:
        dev, n = self._inputs[0], self.graph_max_bs
        i32 = lambda row: dev[row].view(torch.int32)[:bs]  # noqa: E731
        return ForwardBatch(mode="decode", input_ids=dev[0, :bs], positions=dev[1, :bs],
                            out_slots=dev[2, :bs], req_idx=i32(3), seq_lens=i32(4),
                            logits_indices=torch.arange(bs, device=self.device), attn=self.backend,
                            tuning=self.tuning, k=dev[3].view(torch.int32)[n:n + bs],
                            ds_sparse=sparse)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture one decode graph per bucket (and per dense / sparse step with Double Sparsity,
        and per sparse step with and without the recall probe's stash), largest first so smaller
        ones reuse its pool."""
        pool = torch.cuda.graph_pool_handle()
        self._make_inputs()
        modes = (True, False) if getattr(self.backend, "stores_labels", False) else (False,)
        probe = getattr(self.backend, "recall_probe", None)
        keys = [(b, sp, False) for b in graph_buckets(self.graph_max_bs) for sp in modes]
        if probe is not None:
            keys += [(b, True, True) for b in graph_buckets(self.graph_max_bs) if True in modes]
        stash: dict[int, tuple] = {}
        for bs, sparse, with_stash in sorted(keys, reverse=True):
            batch = self._static_batch(bs, sparse)
            self.backend.plan(batch)
            with probe.capturing(with_stash) if probe is not None else contextlib.nullcontext():
                g, logits = self._capture(batch, pool)
            if with_stash:
                stash[bs] = (g, batch, logits)
            else:
                self.graphs[(bs, sparse)] = (g, batch, logits)
        self.graphs = {k: (*v, stash.get(k[0]) if k[1] else None) for k, v in sorted(self.graphs.items())}
        torch.cuda.synchronize(self.device)

    def _capture(self, batch: ForwardBatch, pool) -> tuple:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up (Triton autotune / lazy init) outside the capture
                self._graph_step(batch)
        torch.cuda.current_stream(self.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            logits = self._graph_step(batch)
        return g, logits

    def _graph_step(self, batch: ForwardBatch) -> torch.Tensor:
        """The captured decode step. It records each new token's slot in the device req_to_token
        itself (padding rows write slot 0 to the padding row), so the host skips that update's
        copies and index_put launches (``KVMemory.assign(write_device=False)``)."""
        self.memory.req_to_token.index_put_((batch.req_idx.long(), batch.positions),
                                            batch.out_slots.to(torch.int32))
        return self.model(batch.input_ids, batch.positions, batch)

    def _replay_packed(self, key: tuple[int, bool], B: int, tokens, positions, slots: np.ndarray,
                       rows, ks) -> torch.Tensor:
        """One decode step through the graph ``key`` = (bucket >= B, sparse), the one with the
        recall probe's stash on a step it samples: padding is filled on the host, then one pinned
        H2D copy of the whole (tiny) input buffer (separate copies per field cost ~0.5 ms of host
        time per step)."""
        g, sb, logits, stash = self.graphs[key]
        if stash is not None and self._sampled(key[1]):
            g, sb, logits = stash
        dev, host, h64, h32, copied = self._inputs
        copied.synchronize()  # the previous step's copy has read the host buffer (normally long done)
        on_device = isinstance(tokens, torch.Tensor)
        h64[0, :B] = 0 if on_device else tokens
        h64[1, :B] = positions
        h64[2, :B] = slots
        h64[:3, B:] = 0
        h32[0, :B] = rows
        h32[1, :B] = h64[1, :B] + 1
        h32[0, B:] = 0
        h32[1, B:] = 1  # rows a previous, larger batch filled go back to padding
        k32 = h64[3].view(np.int32)[self.graph_max_bs:]
        k32[:B] = DENSE if ks is None else ks
        k32[B:] = DENSE
        dev.copy_(host, non_blocking=True)
        copied.record(torch.cuda.current_stream(self.device))
        if on_device:
            dev[0, :B].copy_(tokens)
        g.replay()
        return logits[:B].clone()
