"""Waiting requests in fair admission order. Plain Python.

Requests carry a *group*: the client request they belong to (the ``n`` x ``best_of`` x prompts
siblings of one OpenAI request share one; a plain request is a group of its own). Admission takes
groups in round robin, and FCFS within a group: after one of a group's requests is admitted the
group goes to the back of the line, so a request that arrives behind 16,384 siblings of another
is next but one, not 16,385th. With one request per group this is plain FCFS.

Every operation is O(1) (``remove`` by id too), so aborting a large fan-out, request by request,
stays linear in its size.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    def __init__(self) -> None:
        self._groups: OrderedDict[str, OrderedDict[str, T]] = OrderedDict()  # group -> rid -> item
        self._group_of: dict[str, str] = {}                                # rid -> group

    def add(self, rid: str, group: str, item: T) -> None:
        if rid in self._group_of:
            raise ValueError(f"request id {rid!r} is already waiting")
        self._group_of[rid] = group
        self._groups.setdefault(group, OrderedDict())[rid] = item  # a new group joins at the back

    def head(self, skip: Callable[[str], bool] | None = None) -> T | None:
        """The next request to admit: the first group's oldest (None when empty). ``skip(group)``
        True passes over that group for this pick (e.g. one that holds the last free slot's
        claim already)."""
        for g, items in self._groups.items():
            if skip is None or not skip(g):
                return next(iter(items.values()))
        return None

    def take(self, rid: str) -> T:
        """Remove ``rid`` for admission: its group goes to the back of the line."""
        g = self._group_of[rid]
        item = self.remove(rid)
        if g in self._groups:
            self._groups.move_to_end(g)
        return item

    def remove(self, rid: str) -> T:
        """Remove ``rid`` (aborted while waiting); the order of the others is unchanged."""
        g = self._group_of.pop(rid)
        items = self._groups[g]
        item = items.pop(rid)
        if not items:
            del self._groups[g]
        return item

    def get(self, rid: str) -> T | None:
        g = self._group_of.get(rid)
        return None if g is None else self._groups[g][rid]

    def __contains__(self, rid: object) -> bool:
        return rid in self._group_of

    def __len__(self) -> int:
        return len(self._group_of)

    def __bool__(self) -> bool:
        return bool(self._group_of)

    def __iter__(self) -> Iterator[T]:
        """Every waiting request in the order admission would take them (no skips)."""
        lanes = deque(iter(items.values()) for items in self._groups.values())
        while lanes:
            lane = lanes.popleft()
            for item in lane:
                yield item
                lanes.append(lane)
                break

    @property
    def num_groups(self) -> int:
        return len(self._groups)
