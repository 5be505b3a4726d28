"""The prefix cache's radix tree alone (plain Python): matching, splitting, locking, LRU eviction."""

import ast
import random
from pathlib import Path

from doublesparse.engine.radix_cache import RadixCache, common_len


def vals_of(key):
    """Values that identify a token by its whole prefix: any correct tree returns exactly these
    for a match, whichever insert supplied the slots."""
    return [tuple(key[: i + 1]) for i in range(len(key))]


def flat(pieces):
    return [v for p in pieces for v in p]


def test_no_torch_import():
    src = (
        Path(__file__).resolve().parents[2]
        / "doublesparse"
        / "engine"
        / "radix_cache.py"
    )
    tree = ast.parse(src.read_text())
    mods = {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    mods |= {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
    }
    assert not any(m.split(".")[0] == "torch" for m in mods)


def test_common_len():
    assert common_len([1, 2, 3], [9, 1, 2, 3, 4], 1) == 3
    assert common_len([1, 2, 3, 4, 5], [1, 2, 7], 0) == 2
    assert common_len([5], [1], 0) == 0
    a = list(range(1000))
    b = a[:613] + [-1] + a[614:]
    assert common_len(a, b, 0) == 613


def test_insert_match_split_and_lock():
    c = RadixCache()
    a = [1, 2, 3, 4, 5]
    assert c.insert(a, vals_of(a))[0] == 0
    pieces, node, m = c.match_prefix([1, 2, 3, 9])
    assert m == 3 and flat(pieces) == vals_of(a)[:3] and len(node) == 3  # split at 3
    b = [1, 2, 3, 7, 8]
    present, leaf = c.insert(b, [("dup",)] * 3 + vals_of(b)[3:])
    assert present == 3 and leaf.key == [7, 8]
    assert c.total_size == 7 and c.evictable_size == 7
    c.lock(leaf)
    assert (
        c.protected_size == 5 and c.evictable_size == 2
    )  # [1,2,3] and [7,8] locked, [4,5] not
    assert c.peek([1, 2, 3, 4, 6]) == (4, 1)
    c.check()
    assert flat(c.evict(100)) == vals_of(a)[3:]  # only the unlocked branch
    assert c.peek([1, 2, 3, 4]) == (3, 0)
    c.unlock(leaf)
    c.check()
    assert sorted(flat(c.flush())) == sorted(vals_of(b))
    assert c.total_size == 0 and not c.root.children


def test_evicts_least_recently_used_first():
    c = RadixCache()
    keys = [[i, i + 100, i + 200] for i in range(4)]
    for k in keys:
        c.insert(k, vals_of(k))
    c.match_prefix(keys[0])  # used again: now the most recent
    out = c.evict(5)  # whole leaves: two of them
    assert [p[0][0] for p in out] == [1, 2]
    assert c.peek(keys[0])[0] == 3 and c.peek(keys[3])[0] == 3


def test_peek_changes_nothing():
    c = RadixCache()
    c.insert([1, 2, 3, 4], vals_of([1, 2, 3, 4]))
    assert c.peek([1, 2, 9]) == (2, 2)
    assert list(c.root.children[1].key) == [1, 2, 3, 4]  # not split


def test_random_operations_keep_invariants():
    rng = random.Random(5)
    c = RadixCache()
    inserted, locks = [], []
    for _ in range(400):
        op = rng.random()
        key = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        if op < 0.4:
            c.insert(key, vals_of(key))
            inserted.append(key)
        elif op < 0.7:
            pieces, node, m = c.match_prefix(key)
            assert flat(pieces) == vals_of(key)[:m]
            assert m == c.peek(key)[0]
            if rng.random() < 0.5:
                c.lock(node)
                locks.append(node)
        elif op < 0.85 and locks:
            c.unlock(locks.pop(rng.randrange(len(locks))))
        else:
            before = c.total_size
            freed = flat(c.evict(rng.randrange(1, 8)))
            assert c.total_size == before - len(freed)
            inserted.clear()
        c.check()
        for k in inserted[
            -3:
        ]:  # nothing evicted since they went in: all of each is cached
            assert c.peek(k)[0] == len(k)
    for n in locks:
        c.unlock(n)
    c.flush()
    assert c.total_size == 0 and c.evictable_size == 0 and c.protected_size == 0
