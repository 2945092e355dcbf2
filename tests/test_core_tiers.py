"""The host tier of RadixTree (HiCache bookkeeping): unit tests of each operation, run on
both tree-core backends. The randomized tests against a reference model of the tiers, and the
differential test of both cores, are in test_core_tiers_model.py.
"""

from __future__ import annotations

import numpy as np
import pytest


def ids(arr) -> list[int]:
    assert isinstance(arr, np.ndarray) and arr.dtype == np.int64 and arr.ndim == 1
    return arr.tolist()


@pytest.fixture
def tiers(core):
    return core


def host_only_tree(core, tokens, host_slots=16, slots=None):
    """A tree whose only node (tokens) has been backed up and evicted from the device."""
    t = core.RadixTree(1, "lru", host_slots)
    _, leaf = t.insert(tokens, slots if slots is not None else range(10, 10 + len(tokens)))
    t.backup(leaf, 1)
    assert len(t.evict(len(tokens))) == len(tokens)
    return t, leaf


# ---------------------------------------------------------------------------- unit tests
def test_no_host_tier_by_default(tiers):
    t = tiers.RadixTree()
    assert (t.host_capacity(), t.host_available_size(), t.host_used_size()) == (0, 0, 0)
    _, leaf = t.insert([1, 2, 3], [4, 5, 6])
    src, dst = t.backup(leaf, 1)
    assert ids(src) == [] and ids(dst) == []
    freed, src, dst = t.evict_write_back(3)
    assert ids(freed) == [4, 5, 6] and ids(src) == [] and ids(dst) == []
    assert t.node_count() == 0 and t.evict_host(5) == 0
    t.sanity_check()


def test_host_slots_validation(tiers):
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ValueError):
            tiers.RadixTree(1, "lru", bad)
    with pytest.raises(ValueError):
        tiers.RadixTree(4, "lru", 2**32)
    t = tiers.RadixTree(4, "lru", 10)
    assert t.host_capacity() == 8  # whole pages only


def test_backup_evict_load_back_round_trip(tiers):
    t = tiers.RadixTree(1, "lru", 16)
    _, leaf = t.insert([1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15])
    src, dst = t.backup(leaf, 1)
    assert ids(src) == [10, 11, 12, 13, 14, 15] and ids(dst) == [1, 2, 3, 4, 5, 6]
    assert t.host_used_size() == 6 and t.host_available_size() == 10
    assert [ids(a) for a in t.backup(leaf, 1)] == [[], []]  # already backed up
    assert ids(t.evict(1)) == [10, 11, 12, 13, 14, 15]
    assert t.node_count() == 1 and t.total_size() == 0 and t.host_used_size() == 6
    slots, node = t.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert ids(slots) == [] and node == 0
    dev, dev_node, host, host_node = t.match_prefix_host([1, 2, 3, 4, 5, 6, 7])
    assert (ids(dev), dev_node, ids(host), host_node) == ([], 0, [1, 2, 3, 4, 5, 6], leaf)
    t.load_back(leaf, [20, 21, 22, 23, 24, 25])
    slots, node = t.match_prefix([1, 2, 3, 4, 5, 6])
    assert ids(slots) == [20, 21, 22, 23, 24, 25] and node == leaf
    assert t.evictable_size() == 6 and t.host_used_size() == 6  # it keeps its host copy
    t.sanity_check()
    assert ids(t.evict(6)) == [20, 21, 22, 23, 24, 25]  # backed up: only the device copy goes
    assert t.node_count() == 1
    t.sanity_check()


def test_load_back_arguments(tiers):
    t, leaf = host_only_tree(tiers, [1, 2, 3, 4])
    with pytest.raises(ValueError):
        t.load_back(leaf, [1, 2, 3])
    with pytest.raises(ValueError):
        t.load_back(leaf, [1, 2, 3, -4])
    with pytest.raises(ValueError):
        t.load_back(leaf + 100, [1, 2, 3, 4])
    t.load_back(0, [])  # the root (or any device-resident node) with no slots: a no-op
    with pytest.raises(ValueError):
        t.load_back(0, [7])
    t.sanity_check()
    t.load_back(leaf, np.array([5, 6, 7, 8], dtype=np.int32))
    t.load_back(leaf, [])
    assert ids(t.match_prefix([1, 2, 3, 4])[0]) == [5, 6, 7, 8]
    t.sanity_check()


def test_evict_deletes_unbacked_node_with_host_only_descendants(tiers):
    t = tiers.RadixTree(1, "lru", 16)
    _, upper = t.insert([1, 2], [10, 11])
    _, lower = t.insert([1, 2, 3, 4], [10, 11, 12, 13])
    freed, src, dst = t.evict_write_back(1)  # the leaf goes first: backed up, kept host-only
    assert ids(freed) == [12, 13] and ids(src) == [12, 13] and ids(dst) == [1, 2]
    assert t.node_count() == 2 and t.host_used_size() == 2
    t.sanity_check()
    assert ids(t.evict(1)) == [10, 11]  # no host copy: deleted, and its host-only child too
    assert t.node_count() == 0 and t.host_used_size() == 0 and t.total_size() == 0
    t.sanity_check()
    # the freed host pages are reusable
    _, leaf = t.insert([5], [9])
    assert ids(t.backup(leaf, 1)[1]) == [3]
    with pytest.raises(ValueError):
        t.lock(lower)


def test_evict_write_back_without_host_room_deletes(tiers):
    t = tiers.RadixTree(1, "lru", 2)
    t.insert([1, 2, 3], [10, 11, 12])
    freed, src, dst = t.evict_write_back(3)
    assert ids(freed) == [10, 11, 12] and ids(src) == [] and ids(dst) == []
    assert t.node_count() == 0 and t.host_used_size() == 0
    t.sanity_check()


def test_backed_up_parent_becomes_a_candidate_when_its_child_goes_host_only(tiers):
    t = tiers.RadixTree(1, "lru", 16)
    t.insert([1, 2], [10, 11])
    _, leaf = t.insert([1, 2, 3, 4], [10, 11, 12, 13])
    t.backup(leaf, 1)
    assert ids(t.evict(2)) == [12, 13]
    assert ids(t.evict(1)) == [10, 11]  # the parent joined the candidates
    dev, dev_node, host, host_node = t.match_prefix_host([1, 2, 3, 4])
    assert (ids(dev), dev_node, ids(host), host_node) == ([], 0, [1, 2, 3, 4], leaf)
    assert t.node_count() == 2
    t.sanity_check()


def test_backup_min_hits_and_host_shortage(tiers):
    t = tiers.RadixTree(1, "lru", 4)
    t.insert([1, 2], [10, 11])
    _, leaf = t.insert([1, 2, 3, 4], [10, 11, 12, 13])  # [1, 2] has 2 hits, [3, 4] one
    src, dst = t.backup(leaf, 2)
    assert ids(src) == [10, 11] and ids(dst) == [1, 2]
    src, dst = t.backup(leaf, 1)
    assert ids(src) == [12, 13] and ids(dst) == [3, 4]
    _, other = t.insert([7, 8], [20, 21])
    assert [ids(a) for a in t.backup(other, 1)] == [[], []]  # host full, nothing host-only
    assert ids(t.evict(2)) == [12, 13]  # lru: [3, 4] is older; backed up, it stays host-only
    src, dst = t.backup(other, 1)  # evicts the host-only [3, 4] to make room
    assert ids(src) == [20, 21] and ids(dst) == [3, 4]
    assert ids(t.match_prefix_host([1, 2, 3, 4])[2]) == []
    t.sanity_check()


def test_host_eviction_order_and_locks(tiers):
    t = tiers.RadixTree(1, "lru", 6)
    leaves = []
    for tok in (1, 2, 3):
        _, leaf = t.insert([tok, tok], [10 * tok, 10 * tok + 1])
        t.backup(leaf, 1)
        leaves.append(leaf)
    t.evict(6)
    assert t.node_count() == 3 and t.total_size() == 0 and t.host_used_size() == 6
    t.match_prefix_host([1, 1])  # touch: [1, 1] is now the most recently used
    t.lock(leaves[1])  # [2, 2] is locked: host eviction skips it
    assert t.evict_host(1) == 2
    assert ids(t.match_prefix_host([3, 3])[2]) == []  # the oldest unlocked one went first
    assert t.evict_host(100) == 2  # [1, 1]; [2, 2] stays locked
    assert t.node_count() == 1 and t.host_used_size() == 2
    t.sanity_check()
    t.unlock(leaves[1])
    assert t.evict_host(1) == 2 and t.node_count() == 0 and t.host_used_size() == 0
    t.sanity_check()


def test_lock_on_host_only_node_counts_after_load_back(tiers):
    t, leaf = host_only_tree(tiers, [1, 2, 3])
    t.lock(leaf)
    assert (t.evictable_size(), t.protected_size()) == (0, 0)
    t.load_back(leaf, [7, 8, 9])
    assert (t.evictable_size(), t.protected_size()) == (0, 3)
    assert ids(t.evict(3)) == []
    t.unlock(leaf)
    assert (t.evictable_size(), t.protected_size()) == (3, 0)
    t.sanity_check()


def test_locked_ancestor_is_not_a_device_candidate(tiers):
    t = tiers.RadixTree(1, "lru", 16)
    _, upper = t.insert([1, 2], [10, 11])
    _, leaf = t.insert([1, 2, 3, 4], [10, 11, 12, 13])
    t.backup(leaf, 1)
    t.evict(2)  # [3, 4] host-only: [1, 2] is a device candidate
    t.lock(leaf)  # locks the path, [1, 2] included
    assert ids(t.evict(10)) == [] and t.protected_size() == 2
    t.unlock(leaf)
    assert ids(t.evict(10)) == [10, 11]
    t.sanity_check()


def test_split_inside_host_only_node(tiers):
    t, leaf = host_only_tree(tiers, [1, 2, 3, 4, 5, 6])
    dev, dev_node, host, upper = t.match_prefix_host([1, 2, 3, 9])
    assert (ids(dev), dev_node, ids(host)) == ([], 0, [1, 2, 3])
    assert upper != leaf and t.node_count() == 2
    t.sanity_check()
    t.load_back(upper, [30, 31, 32])  # only the upper half comes back
    slots, node = t.match_prefix([1, 2, 3, 4, 5, 6])
    assert ids(slots) == [30, 31, 32] and node == upper
    dev, dev_node, host, host_node = t.match_prefix_host([1, 2, 3, 4, 5, 6])
    assert (ids(dev), dev_node, ids(host), host_node) == ([30, 31, 32], upper, [4, 5, 6], leaf)
    assert t.host_used_size() == 6
    t.sanity_check()


def test_insert_gives_host_only_nodes_the_callers_slots(tiers):
    t = tiers.RadixTree(1, "lru", 16)
    t.insert([1, 2], [10, 11])
    _, leaf = t.insert([1, 2, 3, 4], [10, 11, 12, 13])
    t.backup(leaf, 1)
    t.evict(2)  # [3, 4] host-only below the device-resident [1, 2]
    cached, node = t.insert([1, 2, 3, 4, 5], [10, 11, 22, 23, 24])
    assert cached == 2  # the caller keeps (the tree takes) slots 22, 23, 24
    assert node not in (leaf, 0)
    assert ids(t.match_prefix([1, 2, 3, 4, 5])[0]) == [10, 11, 22, 23, 24]
    assert t.total_size() == 5 and t.host_used_size() == 4
    t.sanity_check()


def test_page_size_4_host_pages(tiers):
    t = tiers.RadixTree(4, "lru", 16)
    _, leaf = t.insert(list(range(10)), list(range(100, 110)))
    src, dst = t.backup(leaf, 1)
    assert ids(src) == list(range(100, 108)) and ids(dst) == list(range(4, 12))
    t.evict(8)
    dev, _, host, _ = t.match_prefix_host(list(range(6)))  # one whole page, split there
    assert ids(dev) == [] and ids(host) == [4, 5, 6, 7] and t.node_count() == 2
    t.sanity_check()


def test_reset_frees_the_host_pool(tiers):
    t, leaf = host_only_tree(tiers, [1, 2, 3])
    t.reset()
    assert t.host_used_size() == 0 and t.node_count() == 0
    with pytest.raises(ValueError):
        t.backup(leaf, 1)
    _, leaf = t.insert([4], [5])
    assert ids(t.backup(leaf, 1)[1]) == [1]  # a fresh host allocator
    t.sanity_check()


def test_sanity_check_catches_a_broken_host_ledger(tiers):
    if tiers.name != "python":
        pytest.skip("corrupts the Python twin's internals (the Rust twin: cargo test)")
    t, _ = host_only_tree(tiers, [1, 2, 3])
    t._host.free([1])  # a node still owns host slot 1
    with pytest.raises(RuntimeError, match="host"):
        t.sanity_check()
    t, leaf = host_only_tree(tiers, [1, 2, 3])
    t._nodes[leaf].host_value = None  # neither copy
    with pytest.raises(RuntimeError):
        t.sanity_check()
    t, leaf = host_only_tree(tiers, [1, 2, 3])
    t._nodes[leaf].host_value = np.array([1, 1, 2])  # one slot owned twice
    with pytest.raises(RuntimeError, match="two nodes"):
        t.sanity_check()
    t = tiers.RadixTree(1, "lru", 8)
    t.insert([1, 2], [3, 4])
    t.insert([1, 2, 3], [3, 4, 5])
    t._nodes[1].value = None  # a device-resident child under a host-only... parent
    t._nodes[1].host_value = np.array([1, 2])
    with pytest.raises(RuntimeError):
        t.sanity_check()
