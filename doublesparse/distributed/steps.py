"""Each step's batch, from rank 0 (which schedules) to the other ranks (which only compute).

Rank 0 runs the engine unchanged except for two subclasses built in its place:
  * :class:`RecordingKVMemory` notes the request-table writes that happen outside a forward
    (a cached prefix pointed into a request's row), which the other ranks must mirror;
  * :class:`BroadcastingRunner` sends, before each forward, the step's ForwardBatch: its host
    metadata (mode, rows, prefix and chunk lengths, whether the step decodes sparsely) and the
    noted table writes through the control group, its index tensors in one int64 tensor
    through the device group (they may live on the device: the overlap schedule's input ids
    never visit the host). A CUDA-graph replay is sent as the arguments of the replay.
Every other rank rebuilds the ForwardBatch around its own attention backend and pools
(:func:`run_step`), records the new tokens' slots in its request table as rank 0's
``KVMemory.assign`` did, and runs its shard of the model; the collectives inside the model keep
the ranks in step. Slot and row allocation, the prefix cache and sampling exist on rank 0 only.
"""

from __future__ import annotations

import numpy as np
import torch

from ..attention.batch import ForwardBatch
from ..engine.memory import KVMemory
from ..engine.model_runner import ModelRunner
from ..kernels.transfer import to_device


class RecordingKVMemory(KVMemory):
    """KVMemory that keeps the ``set_row_slots`` writes since the last step for the other ranks."""

    def __init__(self, plan, device):
        super().__init__(plan, device)
        self._writes: list[tuple[int, int, torch.Tensor]] = []

    def set_row_slots(self, row: int, start: int, slots: torch.Tensor) -> None:
        super().set_row_slots(row, start, slots)
        if slots.numel():
            self._writes.append((row, start, slots.to(torch.int64).clone()))

    def take_writes(self) -> np.ndarray | None:
        """``[3, n]`` int64 (row, position, slot) of the writes since the last call, or None."""
        if not self._writes:
            return None
        out = np.concatenate([np.stack([np.full(s.numel(), row), np.arange(start, start + s.numel()), s.numpy()])
                              for row, start, s in self._writes], axis=1)
        self._writes = []
        return out


def apply_writes(memory: KVMemory, writes: np.ndarray | None) -> None:
    if writes is not None:
        t = to_device(torch.from_numpy(writes), memory.device)
        memory.req_to_token[t[0], t[1]] = t[2].to(torch.int32)


def pack(batch: ForwardBatch) -> tuple[tuple, torch.Tensor]:
    """(host metadata, one int64 tensor on the batch's device) of a ForwardBatch."""
    parts = [batch.input_ids, batch.positions, batch.out_slots, batch.req_idx, batch.seq_lens,
             batch.logits_indices]
    if batch.k is not None:
        parts.append(batch.k)
    meta = (batch.mode, batch.num_tokens, batch.batch_size, int(batch.logits_indices.numel()),
            batch.k is not None, batch.rows_host, batch.extend_prefix_lens, batch.extend_lens,
            batch.ds_sparse, batch.exact_logits_rows)
    return meta, torch.cat([p.reshape(-1).to(torch.int64) for p in parts])


def unpack(meta: tuple, packed: torch.Tensor, backend, tuning) -> ForwardBatch:
    mode, T, B, N, has_k, rows, prefix, lens, sparse, exact = meta
    ids, pos, slots, req, seq, idx, *k = packed.split([T, T, T, B, B, N] + ([B] if has_k else []))
    return ForwardBatch(mode=mode, input_ids=ids, positions=pos, out_slots=slots,
                        req_idx=req.to(torch.int32), seq_lens=seq.to(torch.int32), logits_indices=idx,
                        attn=backend, rows_host=tuple(rows), extend_prefix_lens=tuple(prefix),
                        extend_lens=tuple(lens), tuning=tuning,
                        k=k[0].to(torch.int32) if has_k else None, ds_sparse=sparse,
                        exact_logits_rows=tuple(exact))


class BroadcastingRunner(ModelRunner):
    """Rank 0's ModelRunner: every forward and graph replay is first sent to the other ranks
    through ``link`` (:class:`~.group.TPGroup`). Graphs are captured in the constructor, before
    the forward is wrapped, in step with the other ranks' captures."""

    def __init__(self, *args, link, device_group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.link, self.device_group = link, device_group
        self._local_model = self.model
        self.model = self._forward

    def _forward(self, input_ids, positions, batch):
        meta, packed = pack(batch)
        self.link.send(("forward", meta, self.memory.take_writes()), packed, self.device_group)
        try:
            return self._local_model(input_ids, positions, batch)
        except Exception as e:
            raise self.link.explain(e) from e

    def _replay_packed(self, key, B, tokens, positions, slots, rows, ks):
        on_device = isinstance(tokens, torch.Tensor)
        msg = ("replay", key, B, None if on_device else list(tokens), list(positions), slots.tolist(),
               list(rows), None if ks is None else list(ks), self.memory.take_writes())
        self.link.send(msg, tokens.reshape(-1).to(torch.int64) if on_device else None, self.device_group)
        try:
            return super()._replay_packed(key, B, tokens, positions, slots, rows, ks)
        except Exception as e:
            raise self.link.explain(e) from e


@torch.inference_mode()
def run_step(runner: ModelRunner, msg: tuple, recv_tensor) -> None:
    """A non-zero rank's part of one step sent by :class:`BroadcastingRunner`; ``recv_tensor(n,
    device)`` receives the step's int64 tensor of ``n`` elements."""
    mem = runner.memory
    if msg[0] == "forward":
        _, meta, writes = msg
        mode, T, B, N, has_k = meta[:5]
        packed = recv_tensor(3 * T + 2 * B + N + (B if has_k else 0), runner.device)
        apply_writes(mem, writes)
        batch = unpack(meta, packed, runner.backend, runner.tuning)
        rows = batch.req_idx.long()
        if mode == "prefill":
            rows = torch.repeat_interleave(rows, to_device(torch.tensor(batch.extend_lens), rows.device),
                                           output_size=T)
        mem.req_to_token[rows, batch.positions] = batch.out_slots.to(torch.int32)
        runner.backend.plan(batch)
        runner.model(batch.input_ids, batch.positions, batch)
    elif msg[0] == "replay":
        _, key, B, tokens, positions, slots, rows, ks, writes = msg
        if tokens is None:
            tokens = recv_tensor(B, runner.device)
        apply_writes(mem, writes)
        runner._replay_packed(key, B, tokens, positions, np.asarray(slots, dtype=np.int64), rows, ks)
    else:
        raise ValueError(f"unknown step message {msg[0]!r}")
