"""The engine's side of the prefix cache: moves slots between request rows and cache nodes.

The scheduler (plain Python, :mod:`doublesparse.engine.scheduler`) decides what is matched,
cached and evicted; these functions carry it out on the pools (:class:`~.memory.KVMemory`).
Cache node values are ``[n]`` int64 host tensors of slots. A slot holds a token's K, V and
Double Sparsity label in every layer, so sharing the slot shares all three.

Ownership of a request row's positions ``[0, num_cached)``: the first ``SchedRequest.cached``
belong to the cache (locked for the request, freed only by eviction), the rest to the request
(freed when it ends, unless it leaves them in the cache then).

A request whose row ``memory.caches_row`` refuses (one in DS-Offload's device tier:
engine/offload_memory.py) caches none of its own tokens; it may still start from a cached prefix.
"""

from __future__ import annotations

import torch


def _cat(values) -> torch.Tensor:
    return (
        torch.cat([v.reshape(-1) for v in values])
        if values
        else torch.zeros(0, dtype=torch.int64)
    )


def apply_admission(memory, plan, rows: dict) -> None:
    """After ``Scheduler.schedule``: free the slots of evicted cache nodes and point every
    admitted request that hit the cache at the cached slots. ``rows``: rid -> its row."""
    memory.free_values(plan.evicted)
    for hit in plan.prefix_hits:
        memory.set_row_slots(rows[hit.rid], 0, _cat(hit.values))


def cache_prefill(memory, scheduler, chunks, rows: dict) -> None:
    """After a prefill launch: cache each request's prompt so far, so that requests admitted
    from the next step on reuse it. Where another request cached the same tokens first, this
    request's copies are freed and its row points at the cached slots."""
    if scheduler.cache is None:
        return
    for c in chunks:
        row = rows[c.rid]
        if not memory.caches_row(row):
            continue
        remap = scheduler.cache_prefill(c.rid, c.end, memory.row_slots(row, c.end))
        if remap is not None:
            memory.free_row_range(row, remap.start, remap.stop)
            memory.set_row_slots(
                row, remap.start, _cat(remap.values)[remap.start : remap.stop]
            )


def release_request(
    memory,
    scheduler,
    rid: str,
    row: int | None,
    token_ids: list[int],
    num_cached: int,
    failed: bool = False,
) -> None:
    """End request ``rid`` in the scheduler and the pools. Its tokens with K/V (the first
    ``num_cached`` of ``token_ids``, prompt then output) stay in the cache unless ``failed`` (a
    step raised: its row may hold slots past ``num_cached`` and their contents are suspect)."""
    if row is None:
        scheduler.finish(rid)
        return
    if failed:
        shared = scheduler.cache_finished(rid, [], None)[0]
        scheduler.finish(rid)
        memory.release_row(row, start=shared)
        return
    if not memory.caches_row(row):
        shared = scheduler.cache_finished(rid, [], None)[0]
        scheduler.finish(rid)
        memory.release(row, num_cached, start=shared)
        return
    n = min(num_cached, len(token_ids))
    shared, dup_start, dup_stop = scheduler.cache_finished(
        rid, token_ids[:n], memory.row_slots(row, n)
    )
    memory.free_row_range(row, dup_start, dup_stop)
    scheduler.finish(rid)
    memory.release(row, num_cached, start=shared)


def flush(memory, scheduler) -> int:
    """Evict every cached prefix no running request holds; returns the slots freed."""
    values = scheduler.flush_cache()
    memory.free_values(values)
    return sum(int(v.numel()) for v in values)
