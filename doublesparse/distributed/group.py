"""The processes of a tensor-parallel group: rank 0 in this process, ranks 1..N-1 spawned.

    group = TPGroup(2, "cpu")             # spawns rank 1, joins the process group as rank 0
    engine = doublesparse.Engine(..., tp_size=2, tp_group=group)   # or without tp_group: its own
    ...
    engine.close(); group.stop()

Two torch.distributed groups over the same ranks: the default group (NCCL on CUDA, gloo on CPU)
carries the model's collectives and each step's index tensor, with a finite timeout; a gloo
group carries the control messages (pickled objects: build a model, run a step, stop), without
one in practice, because a worker waits in it for as long as the engine is idle. A watchdog
thread polls the worker processes; once one has exited, every later send raises
:class:`TPError` naming the rank and its exit code, and a collective already waiting on it
fails (gloo: the peer's sockets close; NCCL: the group is aborted), so the engine reports the
failure instead of hanging.
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .layers import Collectives
from .process_group import collectives, free_port, join
from .rank import RankContext
from .shard import check_tp
from .worker import worker_main

WATCHDOG_PERIOD_S = 0.2


class TPError(RuntimeError):
    """A rank of the tensor-parallel group failed; the engine cannot go on."""


class TPGroup:
    """Rank 0 of a ``size``-rank group on ``device_type`` ("cpu" or "cuda"; rank r uses cuda:r),
    the other ranks in spawned worker processes (:mod:`.worker`)."""

    def __init__(self, size: int, device_type: str = "cpu"):
        self._subgroups: dict[int, object] = {}
        if size < 2:
            raise ValueError(f"a tensor-parallel group needs at least 2 ranks, got {size}")
        if dist.is_initialized():
            raise ValueError("this process already belongs to a torch.distributed group (another "
                             "tensor-parallel engine?): close it first, or pass its tp_group")
        if device_type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"--tp-size {size} needs {size} GPUs, this machine has {torch.cuda.device_count()}")
        self.size, self.device_type = size, device_type
        self.failure: str | None = None
        port = free_port()
        ctx = mp.get_context("spawn")
        threads = max(1, (os.cpu_count() or 1) // size)
        self.procs = [ctx.Process(target=worker_main, args=(r, size, port, device_type, threads),
                                  name=f"doublesparse-tp{r}", daemon=True) for r in range(1, size)]
        for p in self.procs:
            p.start()
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()
        self.control = self._join(port)

    def _join(self, port: int):
        """Join as rank 0 in a thread, so that a rank dying before it joins (an import error, no
        memory) ends the wait at once instead of after the collective timeout."""
        box: dict = {}

        def run():
            try:
                box["control"] = join(0, self.size, port, self.device_type)[1]
            except BaseException as e:  # handed to the caller below
                box["error"] = e

        t = threading.Thread(target=run, name="tp-join", daemon=True)
        t.start()
        while t.is_alive() and self.failure is None:
            t.join(WATCHDOG_PERIOD_S)
        if "control" in box:
            return box["control"]
        self._stop.set()
        self._kill()
        raise TPError(f"starting the tensor-parallel group failed: {self.failure or box.get('error')}")

    # ---------------------------------------------------------------------------- health
    def _watch(self) -> None:
        while not self._stop.wait(WATCHDOG_PERIOD_S):
            for r, p in enumerate(self.procs, 1):
                if p.exitcode is not None and self.failure is None:
                    self.failure = (f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.exitcode}; "
                                    "the engine cannot continue without it (restart it)")
                    self._abort_collectives()
            if self.failure is not None:
                return

    def _abort_collectives(self) -> None:
        # gloo notices a dead peer by itself (its sockets close); a NCCL collective would wait
        # for the full timeout, so the group is aborted, failing the waiting launches
        if self.device_type == "cuda":
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                try:
                    abort()
                except Exception:  # already torn down
                    pass

    def check(self) -> None:
        """Raise :class:`TPError` when a rank has failed."""
        if self.failure is not None:
            raise TPError(self.failure)

    # -------------------------------------------------------------------------- messages
    def send(self, msg: tuple, tensor: torch.Tensor | None = None, device_group=None) -> None:
        """Control message ``msg`` to every other rank, then ``tensor`` (int64, this rank's
        device) through ``device_group`` (an engine's :meth:`collectives`' group) when the
        message says one follows."""
        self.check()
        try:
            dist.broadcast_object_list([msg], src=0, group=self.control)
            if tensor is not None:
                dist.broadcast(tensor, src=0, group=device_group)
        except Exception as e:
            raise TPError(self._why(e)) from e

    def _why(self, e: BaseException) -> str:
        deadline = time.monotonic() + 1.0  # a peer whose sockets closed is on its way out
        while self.failure is None and time.monotonic() < deadline:
            dead = [(r, p) for r, p in enumerate(self.procs, 1) if p.exitcode is not None]
            if dead:
                r, p = dead[0]
                self.failure = (f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.exitcode}; "
                                "the engine cannot continue without it (restart it)")
            else:
                time.sleep(0.05)
        return self.failure or f"tensor-parallel collective failed: {type(e).__name__}: {e}"

    def explain(self, e: BaseException) -> TPError:
        """The error of a step that failed on rank 0 between sending it and finishing it. The
        other ranks are then inside (or past) collectives rank 0 will not match, so the group
        is done either way: a dead rank (gloo fails its peers' collectives when its sockets
        close) is named, anything else is recorded as rank 0's failure."""
        why = self._why(e)
        if self.failure is None:
            self.failure = (f"a step failed on rank 0 ({type(e).__name__}: {e}); the ranks are out of "
                            "step, restart the engine")
            self._abort_collectives()
            why = self.failure
        return TPError(why)

    def build(self, cfg, model=None) -> Collectives:
        """Ranks ``1 .. cfg.tp_size - 1`` build their part of the engine of ``cfg`` (their shard of
        ``model`` when given, else of ``cfg.model_path``); rank 0 builds its own next, in step
        with them. Returns the engine's collectives (over the first ``tp_size`` ranks: a smaller
        engine may run on a larger group, whose other ranks wait)."""
        if cfg.tp_size > self.size:
            raise ValueError(f"tp_size {cfg.tp_size} exceeds the group's {self.size} ranks")
        self.send(("build", cfg, model))
        try:
            return collectives(0, cfg.tp_size, self.size, self._subgroups)
        except Exception as e:
            raise TPError(self._why(e)) from e

    def release(self) -> None:
        """The other ranks drop their engine parts (the group stays up for the next engine)."""
        if self.failure is None and self.procs:
            self.send(("drop",))

    def stop(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if not self.procs:
            return
        self._stop.set()  # the workers' exits from here on are expected
        if self.failure is None:
            try:
                self.send(("stop",))
                for p in self.procs:
                    p.join(10.0)
            except TPError:
                pass
        self._kill()  # after a failure the others wait in a collective that will never complete
        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        self.procs = []


def start(cfg, model=None, group=None) -> RankContext:
    """Rank 0 of the engine of ``cfg`` (``cfg.tp_size`` ranks): on the first ranks of ``group``
    when given, else on a group started here; the other ranks begin building."""
    if cfg.use_double_sparsity and cfg.ds_channel_config_path == "auto":
        raise ValueError("--ds-channel-config-path auto calibrates on one device: run `doublesparse "
                         "calibrate` (or this command with --tp-size 1) once and pass the config it writes")
    if model is not None:
        check_tp(model.config, cfg.tp_size, cfg.use_double_sparsity)
    else:  # before any process starts: a model the sizes do not fit is one line, not N tracebacks
        from ..models import load_config
        check_tp(load_config(cfg.model_path, cfg.load_format), cfg.tp_size, cfg.use_double_sparsity)
    device_type = "cuda" if str(cfg.resolved_device).startswith("cuda") else "cpu"
    if model is not None and not cfg.device:
        device_type = model.embed_tokens.weight.device.type
    if device_type == "cuda" and str(cfg.device or "cuda") not in ("cuda", "cuda:0"):
        raise ValueError(f"--device {cfg.device} with --tp-size {cfg.tp_size}: rank r runs on cuda:r, "
                         "so leave --device out (or pass cuda)")
    owned = group is None
    if owned:
        group = TPGroup(cfg.tp_size, device_type)
    elif cfg.tp_size > group.size:
        raise ValueError(f"tp_size {cfg.tp_size} exceeds the {group.size} ranks of tp_group")
    try:
        # the other ranks get the model through a pickle: from the CPU, or each would unpickle
        # it onto this process's GPU
        comm = group.build(cfg, None if model is None else _on_cpu(model))
    except Exception as e:
        if group.failure is None:
            group.failure = f"starting an engine failed: {type(e).__name__}: {e}"
        group.stop()
        raise
    return RankContext(comm, group, owned)


def _on_cpu(model):
    if model.embed_tokens.weight.device.type == "cpu":
        return model
    import copy
    return copy.deepcopy(model).to("cpu")
