"""HostTierMixin: the host tier of the radix tree (HiCache), residency and both evictions.

Part of `RadixTree` (radix_tree.py holds the contract); `rust/core/src/radix_tree/tiers.rs`
is its twin. The tree only does bookkeeping: every operation that moves KV returns the slots
to copy (`backup`, `evict_write_back`) or takes slots the caller has filled (`load_back`),
and the caller does the copy before anything can reuse the source or the destination.

Invariants kept here: a device-resident node's parent is device-resident (or the root);
the host allocator's used slots are exactly the nodes' host values; the device ledgers
(evictable/protected) count device-resident tokens only.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any

import numpy as np

from sglite.core._arrays import EMPTY, MAX_ID, as_index_array, as_int, as_namespace, as_size

if TYPE_CHECKING:
    from sglite.core.radix_tree import _Node


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else EMPTY.copy()


class HostTierMixin:
    """Host-tier operations of RadixTree (see the module docstrings for the contract)."""

    # ---------------------------------------------------------------- public API
    def host_capacity(self) -> int:
        return self._host.capacity()

    def host_available_size(self) -> int:
        return self._host.available_size()

    def host_used_size(self) -> int:
        return self._host.capacity() - self._host.available_size()

    def match_prefix_host(
        self, tokens: Any, extra_key: str | None = None
    ) -> tuple[np.ndarray, int, np.ndarray, int]:
        """(device_slots, device_node_id, host_slots, host_node_id): the device match, then
        its continuation through host-only nodes (host_node_id == device_node_id if none)."""
        key = self._page_aligned(as_index_array(tokens, "tokens"))
        ns = as_namespace(extra_key)
        self._clock += 1
        node = device_node = self.root
        pos, device, host = 0, [], []
        while pos < len(key):
            step = self._step(node, ns, key, pos)
            if step is None:
                break
            child, n = step
            self._touch(child)
            if child.value is not None:  # device-resident nodes come first on any path
                device.append(child.value)
                device_node = child
            else:
                host.append(child.host_value)
            node, pos = child, pos + n
        return _concat(device), device_node.id, _concat(host), node.id

    def backup(self, node_id: int, min_hits: int) -> tuple[np.ndarray, np.ndarray]:
        """Give a host value to each device-resident node on root..node without one and with
        hits >= min_hits, root first, until the host runs short. Returns (device_src,
        host_dst): the caller copies device[src] -> host[dst]."""
        node: _Node | None = self._get(node_id)
        min_hits = as_int(min_hits, "min_hits")
        path: list[_Node] = []
        while node is not None and node is not self.root:
            path.append(node)
            node = node.parent
        src: list[np.ndarray] = []
        dst: list[np.ndarray] = []
        for node in reversed(path):
            if node.value is None or node.host_value is not None or node.hits < min_hits:
                continue
            host = self._alloc_host(len(node.key))
            if host is None:
                break
            node.host_value = host
            src.append(node.value)
            dst.append(host)
        return _concat(src), _concat(dst)

    def load_back(self, host_node_id: int, device_slots: Any) -> None:
        """Give `device_slots` (root first) to the host-only chain ending at host_node_id; the
        caller has copied host -> device. The nodes keep their host values."""
        node = self._get(host_node_id)
        slots = as_index_array(device_slots, "device_slots")
        if len(slots) and (int(slots.min()) < 0 or int(slots.max()) > MAX_ID):
            raise ValueError(f"device_slots must be in 0..{MAX_ID}")
        chain: list[_Node] = []
        while node is not self.root and node.value is None:
            chain.append(node)
            assert node.parent is not None
            node = node.parent
        chain_len = sum(len(n.key) for n in chain)
        if chain_len != len(slots):
            raise ValueError(
                f"load_back of node {host_node_id} needs {chain_len} device slots "
                f"(its host-only chain), got {len(slots)}"
            )
        pos = 0
        for node in reversed(chain):
            self._set_device_value(node, slots[pos : pos + len(node.key)].copy())
            pos += len(node.key)

    def evict_write_back(self, num_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Like `evict`, but a candidate without a host value gets one first (when the host
        can supply it). Returns (freed_device_slots, device_src, host_dst)."""
        return self._evict_device(as_size(num_tokens, "num_tokens"), write_back=True)

    def evict_host(self, num_tokens: int) -> int:
        """Delete unlocked host-only leaves in policy order until num_tokens host tokens are
        freed or none is left; returns the host tokens freed."""
        return self._evict_host(as_size(num_tokens, "num_tokens"))

    # ---------------------------------------------------------------- internals
    def _evict_device(
        self, num_tokens: int, write_back: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        freed: list[np.ndarray] = []
        src: list[np.ndarray] = []
        dst: list[np.ndarray] = []
        num_freed = 0
        while num_freed < num_tokens and self._heap:
            *_, node_id, version = heapq.heappop(self._heap)
            node = self._nodes.get(node_id)
            if node is None or node.version != version or node_id not in self._leaves:
                continue
            value = node.value
            assert value is not None
            if write_back and node.host_value is None:
                host = self._alloc_host(len(node.key))
                if host is not None:
                    node.host_value = host
                    src.append(value)
                    dst.append(host)
            freed.append(value)
            num_freed += len(value)
            if node.host_value is not None:
                self._drop_device_value(node)
            else:
                self._delete_device_node(node)
        return _concat(freed), _concat(src), _concat(dst)

    def _set_device_value(self, node: _Node, value: np.ndarray) -> None:
        """A host-only node (whose parent is device-resident) gets device slots."""
        parent = node.parent
        assert parent is not None and node.value is None
        node.value = value
        if node.lock_ref:
            self._protected += len(value)
        else:
            self._evictable += len(value)
        parent.num_device_children += 1
        self._refresh(node)
        self._refresh(parent)

    def _drop_device_value(self, node: _Node) -> None:
        """An unlocked device candidate with a host value becomes host-only."""
        parent = node.parent
        assert parent is not None and node.value is not None
        self._evictable -= len(node.key)
        node.value = None
        parent.num_device_children -= 1
        self._refresh(node)
        self._refresh(parent)

    def _delete_device_node(self, node: _Node) -> None:
        """Delete an unlocked device candidate without a host value, with its host-only
        descendants (unlocked, since node is); their host slots go back in one free."""
        host: list[np.ndarray] = []
        stack = list(node.children.values())
        while stack:
            below = stack.pop()
            assert below.host_value is not None
            host.append(below.host_value)
            del self._nodes[below.id]
            self._host_leaves.discard(below.id)
            stack.extend(below.children.values())
        self._host.free(_concat(host))
        self._unlink(node)
        self._leaves.discard(node.id)
        self._evictable -= len(node.key)
        assert node.parent is not None
        node.parent.num_device_children -= 1
        self._refresh(node.parent)

    def _unlink(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(parent, node.ns, node.key, 0)]
        del self._nodes[node.id]

    def _evict_host(self, num_tokens: int) -> int:
        num_freed = 0
        while num_freed < num_tokens and self._host_heap:
            *_, node_id, version = heapq.heappop(self._host_heap)
            node = self._nodes.get(node_id)
            if node is None or node.version != version or node_id not in self._host_leaves:
                continue
            assert node.host_value is not None and node.parent is not None
            self._unlink(node)
            self._host_leaves.discard(node_id)
            self._host.free(node.host_value)
            num_freed += len(node.host_value)
            self._refresh(node.parent)
        return num_freed

    def _alloc_host(self, num_tokens: int) -> np.ndarray | None:
        """Host slots for a node (whole pages), evicting host leaves when short; None if the
        host cannot supply them (whatever host eviction did stays done)."""
        short = num_tokens - self._host.available_size()
        if short > 0:
            self._evict_host(short)
        return self._host.alloc(num_tokens)
