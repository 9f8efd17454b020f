"""The radix tree of the prefix cache on its own: match, insert, split, lock, evict, page
alignment, and (hypothesis) random request lifecycles that keep the slot accounting exact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_proc.radix_cache import RadixCache


def slots(*values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def test_match_insert_and_split():
    tree = RadixCache()
    assert tree.match_prefix([1, 2, 3])[0].tolist() == []
    assert tree.insert([1, 2, 3, 4], slots(10, 11, 12, 13))[0] == 0
    assert tree.match_prefix([1, 2, 3, 4, 5])[0].tolist() == [10, 11, 12, 13]
    got, node = tree.match_prefix([1, 2, 9])  # ends inside the edge: split there
    assert got.tolist() == [10, 11] and node.key == [1, 2] and len(node.children) == 1
    existing, leaf = tree.insert([1, 2, 7, 8], slots(20, 21, 22, 23))  # shares [1, 2]
    assert existing == 2 and leaf.key == [7, 8] and leaf.value.tolist() == [22, 23]
    assert tree.match_prefix([1, 2, 7, 8])[0].tolist() == [10, 11, 22, 23]  # the tree keeps its own 10, 11
    assert tree.total_size == 6 == tree.evictable_size
    tree.check()


def test_locked_nodes_are_never_evicted_and_eviction_is_lru():
    tree = RadixCache()
    tree.insert([1, 2, 3], slots(1, 2, 3))
    tree.insert([5, 6], slots(5, 6))
    tree.insert([7], slots(7))
    _, node = tree.match_prefix([1, 2, 3])  # the most recent access
    tree.lock(node)
    assert (tree.protected_size, tree.evictable_size) == (3, 3)
    assert sorted(tree.evict(1).tolist()) == [5, 6]  # the least recently used leaf first, whole
    assert sorted(tree.evict(100).tolist()) == [7]  # the locked path stays
    assert tree.match_prefix([1, 2, 3])[0].tolist() == [1, 2, 3]
    tree.unlock(node)
    assert sorted(tree.evict(100).tolist()) == [1, 2, 3] and tree.total_size == 0
    tree.check()


def test_eviction_climbs_to_parents_that_become_leaves():
    tree = RadixCache()
    tree.insert([1, 2, 3, 4], slots(1, 2, 3, 4))
    tree.insert([1, 2, 8], slots(9, 9, 8))  # splits [1, 2] | [3, 4], adds [8]
    assert sorted(tree.evict(10).tolist()) == [1, 2, 3, 4, 8]
    assert tree.root.children == {}


def test_pages_match_and_insert_whole_pages_only():
    tree = RadixCache(page_size=4)
    existing, _ = tree.insert(list(range(10)), np.arange(100, 110, dtype=np.int32))
    assert existing == 0 and tree.total_size == 8  # the last 2 tokens are not a whole page
    assert tree.match_prefix(list(range(7)))[0].tolist() == [100, 101, 102, 103]
    assert tree.match_prefix([0, 1, 2, 3, 4, 5, 9, 9])[0].tolist() == [100, 101, 102, 103]
    tree.check()
    with pytest.raises(ValueError):
        RadixCache(page_size=0)


def test_reset_refuses_while_locked_and_returns_every_slot():
    tree = RadixCache()
    _, node = tree.insert([1, 2], slots(3, 4))
    tree.lock(node)
    with pytest.raises(RuntimeError, match="in use"):
        tree.reset()
    tree.unlock(node)
    assert sorted(tree.reset().tolist()) == [3, 4] and tree.total_size == 0


op = st.one_of(
    st.tuples(st.just("start"), st.integers(0, 5), st.integers(1, 12)),  # prefix family, extra tokens
    st.tuples(st.just("finish"), st.integers(0, 30)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("evict"), st.integers(1, 40)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=60), page=st.sampled_from([1, 1, 2, 4]), seed=st.integers(0, 1000))
def test_random_lifecycles_keep_the_slot_accounting_exact(ops, page, seed):
    """Requests match a prefix (locking it), take fresh slots for the rest, and at the end insert
    what they computed (freeing their duplicates of cached tokens) or are aborted (freeing their
    own slots); eviction runs between. Always: free + in the tree + held by requests == the pool,
    no slot twice, and a locked slot is never freed."""
    rng = np.random.default_rng(seed)
    pool_size = 400
    free = list(range(pool_size))
    tree = RadixCache(page)
    families = [rng.integers(0, 50, 24).tolist() for _ in range(6)]
    running = []  # (tokens, slots, cached length, locked node)

    def check():
        tree.check()
        in_tree = tree.all_slots().tolist()
        held = [int(s) for tokens, sl, cached, _ in running for s in sl[cached:]]
        everything = free + in_tree + held
        assert sorted(everything) == list(range(pool_size)), "a slot lost or counted twice"
        locked = {int(s) for _, sl, cached, _ in running for s in sl[:cached]}
        assert locked <= set(in_tree), "a locked slot left the tree"

    for kind, *args in ops:
        if kind == "start":
            family, extra = args
            tokens = families[family][: rng.integers(1, 25)] + rng.integers(50, 99, extra).tolist()
            cached, node = tree.match_prefix(tokens)
            need = len(tokens) - len(cached)
            if need > len(free):
                free.extend(tree.evict(need - len(free)).tolist())
            if need > len(free):
                continue
            tree.lock(node)
            own = np.asarray([free.pop() for _ in range(need)], dtype=np.int32)
            running.append((tokens, np.concatenate([cached, own]), len(cached), node))
        elif kind in ("finish", "abort") and running:
            tokens, sl, cached, node = running.pop(args[0] % len(running))
            if kind == "finish":
                tree.insert(tokens, sl)
                tree_slots, _ = tree.match_prefix(tokens)
                mine = sl[: len(tree_slots)]
                free.extend(int(s) for s in mine[mine != tree_slots])  # duplicates of cached tokens
                free.extend(int(s) for s in sl[len(tree_slots):])  # past the last whole page
            else:
                free.extend(int(s) for s in sl[cached:])
            tree.unlock(node)
        elif kind == "evict":
            protected = tree.protected_size
            free.extend(tree.evict(args[0]).tolist())
            assert tree.protected_size == protected
        check()
    for tokens, sl, cached, node in running:
        free.extend(int(s) for s in sl[cached:])
        tree.unlock(node)
    free.extend(tree.evict(pool_size).tolist())
    assert sorted(free) == list(range(pool_size)) and tree.total_size == 0
