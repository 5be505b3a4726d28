"""What building an engine's parts needs to know about its tensor-parallel rank."""

from __future__ import annotations

from dataclasses import dataclass

from .layers import Collectives
from .loading import load_shard, shard_model
from .shard import Shard, check_tp


@dataclass
class RankContext:
    """Rank ``comm.rank`` of ``comm.size``; ``group``: on rank 0, the :class:`~.group.TPGroup` it
    schedules for (its steps are sent to the other ranks), None on the others. ``owned``: the
    engine started the group and stops it when it closes."""

    comm: Collectives
    group: object = None
    owned: bool = False

    @property
    def rank(self) -> int:
        return self.comm.rank

    def load_model(self, cfg, device, dtype, progress: bool):
        model = load_shard(cfg.model_path, cfg.load_format, dtype, str(device), self.comm, seed=cfg.seed,
                           progress=progress and self.rank == 0)
        if str(device) == "cpu" and not cfg.disable_cpu_packed_weights:
            # as a --tp-size 1 load does: a slice of a 4-bit grid along N, or along K at multiples
            # of the group, is the same grid, so every --tp-size multiplies by the same weights
            from ..models.packed import pack_linears
            pack_linears(model)
        return model

    def shard_model(self, model, device):
        """This rank's part of a full model built by the caller."""
        return shard_model(model, self.comm, device=device)

    def shard(self, full_config) -> Shard:
        check_tp(full_config, self.comm.size)
        return Shard(full_config, self.comm.rank, self.comm.size)

    def agree(self, plan, device):
        """The memory plan every rank can hold: pools sized from each GPU's free memory differ
        between ranks, and a slot index rank 0 hands out must exist on all of them."""
        import dataclasses
        return dataclasses.replace(plan, max_total_tokens=self.comm.min_int(plan.max_total_tokens, device))

    def memory(self, plan, device):
        from ..engine.memory import KVMemory
        from .steps import RecordingKVMemory
        return (RecordingKVMemory if self.group is not None else KVMemory)(plan, device)

    def runner(self, *args, **kwargs):
        from ..engine.model_runner import ModelRunner
        from .steps import BroadcastingRunner
        if self.group is None:
            return ModelRunner(*args, **kwargs)
        return BroadcastingRunner(*args, link=self.group, device_group=self.comm.group, **kwargs)

    def check(self) -> None:
        if self.group is not None:
            self.group.check()

    def abort(self, err: BaseException) -> None:
        """Rank 0 failed while the other ranks build or run (they may wait in a collective it
        will never join): stop their processes, shared group or not."""
        if self.group is not None:
            if self.group.failure is None:
                self.group.failure = f"rank 0 failed: {type(err).__name__}: {err}"
            self.group.stop()

    def close(self) -> None:
        """Rank 0: the other ranks free this engine's parts (and stop, when the engine owns them)."""
        if self.group is None:
            return
        if self.owned:
            self.group.stop()
        else:
            self.group.release()
