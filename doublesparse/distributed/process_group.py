"""Joining a tensor-parallel group's torch.distributed process groups (every rank, same calls)."""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from .layers import Collectives

# Collectives (and starting the group) wait at most this long for the slowest rank: loading
# and capturing a large model's graphs takes minutes on every rank.
COLLECTIVE_TIMEOUT_S = 900.0
# The control group waits while the engine is idle, which may be forever.
CONTROL_TIMEOUT_S = 10 * 365 * 86400.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def join(rank: int, size: int, port: int, device_type: str):
    """Join the group as ``rank``: -> (Collectives, control group)."""
    kw = {}
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend_for(device_type), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S), **kw)
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S))
    return Collectives(rank, size), control


def collectives(rank: int, tp_size: int, size: int, subgroups: dict) -> Collectives:
    """Rank ``rank``'s collectives of an engine over ranks ``0 .. tp_size - 1`` of a ``size``-rank
    group (the default group, or a subgroup made once per size: every rank must call this for
    every engine, in the same order, members or not)."""
    if tp_size == size:
        return Collectives(rank, size)
    if tp_size not in subgroups:
        subgroups[tp_size] = dist.new_group(list(range(tp_size)),
                                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return Collectives(rank, tp_size, subgroups[tp_size])
