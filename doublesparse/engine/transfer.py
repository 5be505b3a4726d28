"""Host-to-device copies that do not block the host.

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
