"""RadixTree contract, run on both tree-core backends."""

from __future__ import annotations

import numpy as np
import pytest


def ids(arr) -> list[int]:
    assert isinstance(arr, np.ndarray) and arr.dtype == np.int64 and arr.ndim == 1
    return arr.tolist()


def test_insert_and_match_page1(core):
    t = core.RadixTree()
    assert t.insert([1, 2, 3, 4], [10, 11, 12, 13]) == (0, 1)
    slots, node = t.match_prefix([1, 2, 3, 4, 5])
    assert ids(slots) == [10, 11, 12, 13] and node == 1
    # second insert shares 2 tokens: the caller frees its own slots for that span
    cached, leaf = t.insert([1, 2, 7], [20, 21, 22])
    assert cached == 2
    slots, node = t.match_prefix([1, 2, 7])
    assert ids(slots) == [10, 11, 22] and node == leaf
    assert t.total_size() == 5 and t.evictable_size() == 5 and t.protected_size() == 0
    assert t.node_count() == 3  # [1,2] split off, [3,4], [7]
    t.sanity_check()


def test_numpy_inputs_any_int_dtype(core):
    t = core.RadixTree()
    t.insert(np.array([5, 6, 7], dtype=np.int32), np.array([1, 2, 3], dtype=np.uint16))
    slots, _ = t.match_prefix(np.array([5, 6, 7], dtype=np.int64))
    assert ids(slots) == [1, 2, 3]


def test_match_miss_returns_root_and_empty(core):
    t = core.RadixTree()
    slots, node = t.match_prefix([9, 9])
    assert ids(slots) == [] and node == 0
    assert ids(t.match_prefix([])[0]) == []


def test_match_splits_node_and_keeps_values(core):
    t = core.RadixTree()
    _, leaf = t.insert([1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16])
    slots, mid = t.match_prefix([1, 2, 3, 9])
    assert ids(slots) == [11, 12, 13]
    assert mid != leaf and t.node_count() == 2
    # the lower half keeps its id, the upper half is new
    slots, node = t.match_prefix([1, 2, 3, 4, 5, 6])
    assert node == leaf and ids(slots) == [11, 12, 13, 14, 15, 16]
    t.sanity_check()


def test_page_size_16_whole_pages(core):
    t = core.RadixTree(page_size=16)
    tokens = list(range(40))
    cached, node = t.insert(tokens, list(range(100, 140)))
    assert cached == 0 and t.total_size() == 32  # truncated to two pages
    slots, _ = t.match_prefix(tokens[:31])
    assert ids(slots) == list(range(100, 116))  # only one whole page matches
    # a divergence inside the second page matches only the first page and splits there
    other = tokens[:20] + [999] * 12
    slots, mid = t.match_prefix(other)
    assert ids(slots) == list(range(100, 116)) and mid != node
    cached, leaf = t.insert(other, list(range(200, 232)))
    assert cached == 16 and t.total_size() == 48
    assert ids(t.match_prefix(other)[0]) == list(range(100, 116)) + list(range(216, 232))
    assert ids(t.match_prefix(tokens[:8])[0]) == []  # shorter than a page
    t.sanity_check()


def test_insert_prefix_of_existing_splits(core):
    t = core.RadixTree()
    t.insert([1, 2, 3, 4], [1, 2, 3, 4])
    cached, node = t.insert([1, 2], [7, 8])
    assert cached == 2 and node != 0
    assert ids(t.match_prefix([1, 2])[0]) == [1, 2]
    t.lock(node)
    assert t.protected_size() == 2 and t.evictable_size() == 2
    t.unlock(node)


def test_duplicate_insert_creates_nothing(core):
    t = core.RadixTree()
    _, n1 = t.insert([3, 4, 5], [1, 2, 3])
    before = t.node_count()
    assert t.insert([3, 4, 5], [7, 8, 9]) == (3, n1)
    assert t.node_count() == before


def test_namespaces_never_share(core):
    t = core.RadixTree()
    t.insert([1, 2, 3], [1, 2, 3], extra_key="a")
    assert ids(t.match_prefix([1, 2, 3])[0]) == []
    assert ids(t.match_prefix([1, 2, 3], extra_key="b")[0]) == []
    assert t.insert([1, 2, 3], [4, 5, 6], extra_key="b")[0] == 0
    assert ids(t.match_prefix([1, 2, 3], extra_key="a")[0]) == [1, 2, 3]
    assert ids(t.match_prefix([1, 2, 3], extra_key="b")[0]) == [4, 5, 6]
    assert t.total_size() == 6
    t.sanity_check()


def test_lock_protects_path_and_moves_sizes(core):
    t = core.RadixTree()
    t.insert([1, 2, 3, 4], [1, 2, 3, 4])
    _, leaf = t.insert([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6])
    t.lock(leaf)
    assert t.protected_size() == 6 and t.evictable_size() == 0
    assert ids(t.evict(100)) == []
    t.lock(leaf)
    t.unlock(leaf)
    assert t.protected_size() == 6
    t.unlock(leaf)
    assert t.protected_size() == 0 and t.evictable_size() == 6
    with pytest.raises(RuntimeError):
        t.unlock(leaf)
    t.sanity_check()


def test_split_inside_locked_node_keeps_lock(core):
    t = core.RadixTree()
    _, leaf = t.insert([1, 2, 3, 4], [5, 6, 7, 8])
    t.lock(leaf)
    _, mid = t.match_prefix([1, 2, 9])
    assert mid != leaf
    assert t.protected_size() == 4 and t.evictable_size() == 0
    assert ids(t.evict(10)) == []
    t.unlock(leaf)  # the upper half's inherited count goes with it
    assert t.protected_size() == 0 and t.evictable_size() == 4
    t.sanity_check()
    assert sorted(ids(t.evict(10))) == [5, 6, 7, 8]


def test_root_lock_counts(core):
    t = core.RadixTree()
    _, root = t.match_prefix([1])
    t.lock(root)
    t.unlock(root)
    with pytest.raises(RuntimeError):
        t.unlock(root)


def test_unknown_and_stale_ids(core):
    t = core.RadixTree()
    _, leaf = t.insert([1, 2], [1, 2])
    with pytest.raises(ValueError):
        t.lock(12345)
    t.evict(2)
    with pytest.raises(ValueError):
        t.lock(leaf)
    _, leaf2 = t.insert([1, 2], [3, 4])
    t.reset()
    assert t.total_size() == 0 and t.node_count() == 0
    with pytest.raises(ValueError):
        t.unlock(leaf2)
    _, leaf3 = t.insert([1, 2], [3, 4])
    assert leaf3 > leaf2  # ids are never reused


def test_evict_lru_order(core):
    t = core.RadixTree()
    t.insert([1, 1], [10, 11])
    t.insert([2, 2], [20, 21])
    t.insert([3, 3], [30, 31])
    t.match_prefix([1, 1])  # 1 becomes the most recent
    assert ids(t.evict(1)) == [20, 21]  # whole leaves, oldest first
    assert ids(t.evict(3)) == [30, 31, 10, 11]
    assert t.total_size() == 0


def test_evict_parent_becomes_candidate(core):
    t = core.RadixTree()
    t.insert([1, 2, 3], [1, 2, 3])
    t.insert([1, 2, 4], [1, 2, 4])
    freed = ids(t.evict(4))
    assert sorted(freed) == [1, 2, 3, 4] and t.total_size() == 0 and t.node_count() == 0
    t.sanity_check()


def test_evict_lfu_fifo_priority(core):
    lfu = core.RadixTree(eviction_policy="lfu")
    lfu.insert([1], [1])
    lfu.insert([2], [2])
    lfu.insert([1], [9])  # hit count of [1] becomes 2
    lfu.match_prefix([2])  # recency does not matter under lfu, hits do
    assert ids(lfu.evict(1)) == [2]

    fifo = core.RadixTree(eviction_policy="fifo")
    fifo.insert([1], [1])
    fifo.insert([2], [2])
    fifo.match_prefix([1])
    assert ids(fifo.evict(1)) == [1]

    prio = core.RadixTree(eviction_policy="priority")
    prio.insert([1], [1], priority=5)
    prio.insert([2], [2], priority=1)
    prio.insert([3], [3], priority=9)
    assert ids(prio.evict(2)) == [2, 1]


def test_evict_zero_and_negative(core):
    t = core.RadixTree()
    t.insert([1], [1])
    assert ids(t.evict(0)) == []
    with pytest.raises(ValueError):
        t.evict(-1)
    assert t.total_size() == 1


def test_dfs_weight_order(core):
    t = core.RadixTree()
    _, a = t.insert([1, 2, 3], [1, 2, 3])
    _, b = t.insert([1, 2, 4], [4, 5, 6])
    _, c = t.insert([7, 8], [7, 8])
    _, ab = t.match_prefix([1, 2])
    # three requests under [1,2] (two at b), one at c, one at the root
    order = t.dfs_weight_order([c, b, 0, a, b])
    assert order == [1, 4, 3, 0, 2]
    with pytest.raises(ValueError):
        t.dfs_weight_order([999])


def test_bad_inputs_leave_tree_unchanged(core):
    with pytest.raises(ValueError):
        core.RadixTree(page_size=0)
    with pytest.raises(ValueError):
        core.RadixTree(eviction_policy="mru")
    t = core.RadixTree(page_size=2)
    t.insert([1, 2], [3, 4])
    before = t.pretty_print()
    bad_calls = [
        lambda: t.insert([1, 2, 3, 4], [1, 2, 3]),  # length mismatch
        lambda: t.insert([1.5, 2.0], [1, 2]),  # floats
        lambda: t.insert(np.array([1.0, 2.0]), np.array([1, 2])),
        lambda: t.insert(np.zeros((2, 2), dtype=np.int64), np.zeros((2, 2), dtype=np.int64)),
        lambda: t.match_prefix(np.zeros((1, 2), dtype=np.int64)),
        lambda: t.match_prefix("12"),
        lambda: t.insert(np.array([True, False]), [1, 2]),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
    assert t.pretty_print() == before
    t.sanity_check()


def test_pretty_print_and_memory(core):
    t = core.RadixTree()
    t.insert(list(range(100)), list(range(100)))
    text = t.pretty_print()
    assert "#tokens: 100" in text
    assert t.memory_bytes() >= 100 * 8 // 2


def test_incremental_eviction_many_leaves(core):
    rng = np.random.default_rng(0)
    t = core.RadixTree()
    n = 2000
    for i in range(n):
        t.insert([i, *rng.integers(0, 50, 5).tolist()], np.arange(i * 6, i * 6 + 6))
    t.sanity_check()
    freed = t.evict(600)
    assert len(freed) == 600 and t.total_size() == n * 6 - 600
    # LRU: the first inserted leaves go first
    assert ids(freed[:6]) == list(range(6))
    t.sanity_check()
