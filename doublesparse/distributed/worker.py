"""The loop of a tensor-parallel rank other than 0, in its own spawned process.

It joins the group (:func:`.group.join`), then waits for control messages from rank 0:
``build`` (its part of an engine: the same :func:`~doublesparse.engine.setup.build_parts` as rank
0, at its own device, with its shard of the model), ``forward`` / ``replay`` (one step,
:func:`.steps.run_step`), ``drop`` (free the engine) and ``stop``. Any error ends the process with
a non-zero exit code after printing its traceback, which rank 0's watchdog reports.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback

import torch
import torch.distributed as dist


def _receiver(group):
    def recv(n: int, device) -> torch.Tensor:
        t = torch.empty(n, dtype=torch.int64, device=device)
        dist.broadcast(t, src=0, group=group)
        return t
    return recv


def _build(cfg, model, comm, device_type: str):
    from ..engine.setup import build_parts
    from .rank import RankContext
    device = f"cuda:{comm.rank}" if device_type == "cuda" else "cpu"
    return build_parts(cfg.replace(device=device), model=model, tokenizer=None, progress=False,
                       tp=RankContext(comm))


def _free(device_type: str) -> None:
    gc.collect()
    if device_type == "cuda":
        torch.cuda.empty_cache()


def worker_main(rank: int, size: int, port: int, device_type: str, threads: int) -> None:
    from .process_group import collectives, join
    from .steps import run_step
    torch.set_num_threads(threads)
    try:
        _, control = join(rank, size, port, device_type)
        parts, subgroups = None, {}
        while True:  # until "stop"
            box = [None]
            try:
                dist.broadcast_object_list(box, src=0, group=control)
            except RuntimeError as e:  # rank 0 exited (its sockets closed): nothing left to serve
                print(f"doublesparse tensor-parallel rank {rank}: lost rank 0 ({str(e).splitlines()[0][:200]}); "
                      "exiting", file=sys.stderr, flush=True)
                os._exit(1)
            msg = box[0]
            if msg[0] == "stop":
                # nothing to tear down that exiting does not: skip the interpreter's slow shutdown
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            if msg[0] in ("build", "drop"):
                parts = None
                _free(device_type)
                if msg[0] == "build":
                    comm = collectives(rank, msg[1].tp_size, size, subgroups)
                    if rank < comm.size:  # else: not in this engine, wait for the next
                        parts = _build(msg[1], msg[2], comm, device_type)
                continue
            if parts is not None:
                run_step(parts.runner, msg, _receiver(comm.group))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)
