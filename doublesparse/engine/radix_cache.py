"""Radix tree over token ids whose nodes own KV slots: the prefix cache. Plain Python (no torch).

A node holds a run of token ids (``key``) and, position for position, the pool slots that hold
their K/V and Double Sparsity labels (``value``; page size 1). The tree treats values as opaque
sequences: it only slices them (``value[:n]``) and hands them back, so the engine stores int64
host tensors of slots and the unit tests plain lists.

Reference counts: a running request locks the deepest node of the prefix it uses, which locks
every node up to the root (``lock_ref``). Unlocked nodes are *evictable*: their slots count as
free space for admission, and ``evict`` drops least-recently-used unlocked leaves until enough
slots are freed. Since a lock always covers the whole path to the root, every unlocked node has
only unlocked descendants, so all ``evictable_size`` tokens can really be evicted.

Sizes (tokens): ``total_size = evictable_size + protected_size``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


class Node:
    __slots__ = ("children", "key", "last_access", "lock_ref", "parent", "value")

    def __init__(
        self,
        key: list,
        value,
        parent: Node | None,
        lock_ref: int = 0,
        last_access: int = 0,
    ):
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = lock_ref
        self.last_access = last_access

    def __len__(self) -> int:
        return len(self.key)


def common_len(a: list, b: list, start: int) -> int:
    """Length of the common prefix of lists ``a`` and ``b[start:]``: whole-slice comparisons (C
    speed), binary-searched where they differ."""
    m = min(len(a), len(b) - start)
    if a[:m] == b[start : start + m]:
        return m
    lo, hi = 0, m  # a[:lo] matches, a[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[start : start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _as_list(key: Sequence[int]) -> list:
    return key if isinstance(key, list) else list(key)


class RadixCache:
    def __init__(self):
        self.root = Node([], [], None, lock_ref=1)  # the root is never evicted
        self.evictable_size = 0
        self.protected_size = 0
        self._clock = itertools.count(1)

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # ----------------------------------------------------------------------------- lookup
    def match_prefix(self, key: Sequence[int]) -> tuple[list, Node, int]:
        """Longest cached prefix of ``key``: (the value pieces covering it, in order; its last
        node; its length). A match ending inside a node splits that node, so the returned node
        covers exactly the match. Marks the path used now (LRU)."""
        key = _as_list(key)
        node, i, vals = self.root, 0, []
        tick = next(self._clock)
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = common_len(child.key, key, i)
            child.last_access = tick
            partial = n < len(child)
            if partial:
                child = self._split(child, n)
            vals.append(child.value)
            i += n
            node = child
            if partial:
                break
        return vals, node, i

    def peek(self, key: Sequence[int]) -> tuple[int, int]:
        """(length of the longest cached prefix of ``key``, how many of those tokens are in
        unlocked nodes). Changes nothing (no split, no LRU update)."""
        key = _as_list(key)
        node, i, unlocked = self.root, 0, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = common_len(child.key, key, i)
            i += n
            unlocked += n if child.lock_ref == 0 else 0
            if n < len(child):
                break
            node = child
        return i, unlocked

    def _split(self, child: Node, n: int) -> Node:
        """Cut ``child`` after ``n`` tokens; returns the new upper part (same lock count)."""
        top = Node(
            child.key[:n],
            child.value[:n],
            child.parent,
            child.lock_ref,
            child.last_access,
        )
        child.key, child.value = child.key[n:], child.value[n:]
        child.parent = top
        top.children[child.key[0]] = child
        top.parent.children[top.key[0]] = top
        return top

    # ----------------------------------------------------------------------------- insert
    def insert(self, key: Sequence[int], value) -> tuple[int, Node]:
        """Cache ``key`` with slots ``value`` (same length). Returns how many leading tokens were
        cached already (their slots in ``value`` are duplicates the caller still owns: the tree
        keeps its own; it takes ownership of the rest of ``value``) and the node ending at the
        end of ``key``."""
        if len(value) != len(key):
            raise ValueError(f"{len(key)} tokens but {len(value)} slots")
        key = _as_list(key)
        node, i = self.root, 0
        tick = next(self._clock)
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                leaf = Node(key[i:], value[i:], node, 0, tick)
                node.children[key[i]] = leaf
                self.evictable_size += len(leaf)
                return i, leaf
            n = common_len(child.key, key, i)
            if n < len(child):
                child = self._split(child, n)
            child.last_access = tick
            i += n
            node = child
        return i, node

    # ---------------------------------------------------------------------------- locking
    def lock(self, node: Node) -> None:
        """A request uses the prefix ending at ``node``: protect the whole path."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node)
                self.protected_size += len(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise ValueError("unlocking a prefix-cache node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node)
                self.protected_size -= len(node)
            node = node.parent

    # --------------------------------------------------------------------------- eviction
    def _nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self.root:
                yield n

    def evict(self, num_tokens: int) -> list:
        """Drop least-recently-used unlocked leaves until at least ``num_tokens`` tokens are freed
        (or nothing evictable is left). Returns the dropped nodes' values: the caller frees them."""
        heap = [
            (n.last_access, id(n), n)
            for n in self._nodes()
            if not n.children and n.lock_ref == 0
        ]
        heapq.heapify(heap)
        freed, out = 0, []
        while freed < num_tokens and heap:
            _, _, n = heapq.heappop(heap)
            out.append(n.value)
            freed += len(n)
            self.evictable_size -= len(n)
            parent = n.parent
            del parent.children[n.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return out

    def flush(self) -> list:
        """Evict everything unlocked (all of it when no request holds a prefix)."""
        return self.evict(self.evictable_size)

    # ------------------------------------------------------------------------------ checks
    def check(self) -> None:
        """Assert the invariants (tests): sizes add up, locks cover paths, keys start their edges."""
        ev = pr = 0
        for n in self._nodes():
            assert len(n.key) == len(n.value) > 0, "empty or mismatched node"
            assert n.parent.children.get(n.key[0]) is n, (
                "edge key differs from the node's first token"
            )
            assert n.lock_ref >= sum(c.lock_ref for c in n.children.values()), (
                "a node locked less often than its children together"
            )
            if n.lock_ref:
                pr += len(n)
            else:
                ev += len(n)
        assert (ev, pr) == (self.evictable_size, self.protected_size), (
            f"sizes {(self.evictable_size, self.protected_size)} != counted {(ev, pr)}"
        )
