"""Copies between host and device that do not block the host.

A plain ``.to("cuda")`` of pageable host memory waits until the stream has finished its queued
work. The engine's overlap schedule launches step n+1 while step n still runs, so such a copy would
stall the host until step n is done: small per-step inputs go through pinned memory instead.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` (a small host tensor) on ``device``; on CUDA via pinned memory and an async copy
    (torch's pinned allocator keeps the buffer until the copy has run)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_host_async(t: torch.Tensor):
    """Start copying ``t`` to the host. Returns ``(host tensor, event)``: on CUDA a pinned tensor
    that is valid once ``event`` has completed; elsewhere ``t`` itself and None."""
    if not t.is_cuda:
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event
