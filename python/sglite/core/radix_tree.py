"""RadixTree: the prefix-cache index (token ids -> KV slots), pure-Python twin of the Rust core.

This file is the readable specification; `rust/core/src/radix_tree.rs` must behave the same,
down to node ids, eviction order and error types.

Contract
- Keys are token ids matched in whole pages; a match ends on a page boundary, and a node is
  split where a match (or an insert) ends inside it. `extra_key` namespaces the key: equal
  tokens under different keys never share nodes ("" means no namespace, like None).
- Values are one KV slot per token. `insert` returns `cached_len`, the tokens already present;
  the tree keeps its own slots and the caller frees its duplicates for that span.
- Node ids: the root is 0; other nodes get 1, 2, ... in creation order and ids are never
  reused (not even across `reset()`), so a stale id is always detected (ValueError).
- Time is a logical clock: each `match_prefix`/`insert` call is one tick; every node on the
  walked path gets that tick as its access time. A split's upper half takes the tick; the
  lower half keeps its old access time.
- Locks count references along the path to the root; tokens move between evictable and
  protected only on 0 <-> 1 transitions. The root can be locked too (a miss locks it); that
  only counts, it protects nothing.
- Eviction removes unlocked leaves, smallest key first: lru (access, id); lfu (hits, access,
  id); fifo (creation, id); priority (priority, access, id). A parent that becomes an unlocked
  leaf joins the candidates. The candidate set is maintained incrementally: a heap with lazy
  deletion (each entry carries the node's version), compacted when stale entries dominate.
- hit_count: 1 at creation, +1 per insert walking through; priority: max over inserts.

Host tier (HiCache, `host_slots` > 0; the operations live in `radix_tiers.py`)
- Each node has a device value (`value`, KV slots) and/or a host value (`host_value`, slots of
  an internal host `PageAllocator(host_slots, page_size)`); at least one. A device-resident
  node's parent is device-resident (or the root), so host-only nodes hang below the device
  part of the tree and their children are host-only.
- `evictable_size`/`protected_size` count device-resident tokens only; locks count on every
  node. `match_prefix` stops at the first host-only node; `match_prefix_host` continues.
- Device eviction takes unlocked device-resident nodes without a device-resident child (in
  the order above): one with a host value becomes host-only, one without is deleted with its
  host-only descendants (their host slots are freed). Host eviction takes unlocked host-only
  nodes without children, in the same order, from a second lazy-deletion heap.
- `insert` walking into host-only nodes gives them the caller's slots (they become
  device-resident again); `cached_len` counts only the span that was already on the device.
- With host_slots == 0 every node is device-resident and all of the above is today's tree.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from sglite.core._arrays import EMPTY, MAX_ID, as_index_array, as_int, as_namespace, as_size
from sglite.core.page_allocator import PageAllocator
from sglite.core.radix_inspect import InspectMixin
from sglite.core.radix_tiers import HostTierMixin

POLICIES = ("lru", "lfu", "fifo", "priority")


class _Node:
    __slots__ = (
        "id", "parent", "key", "value", "host_value", "children", "num_device_children",
        "lock_ref", "access", "creation", "hits", "priority", "version", "ns",
    )  # fmt: skip

    def __init__(self, node_id: int, parent: _Node | None, key: np.ndarray, value: np.ndarray):
        self.id = node_id
        self.parent = parent
        self.key = key
        self.value: np.ndarray | None = value  # device slots; None: host-only
        self.host_value: np.ndarray | None = None  # host slots; None: not backed up
        self.children: dict[Any, _Node] = {}
        self.num_device_children = 0
        self.lock_ref = 0
        self.access = 0
        self.creation = 0
        self.hits = 1
        self.priority = 0
        self.version = 0
        self.ns: str | None = None  # namespace (extra_key); the edge key uses it at the root


class RadixTree(HostTierMixin, InspectMixin):
    """Prefix cache index. See the module docstring for the full contract."""

    def __init__(self, page_size: int = 1, eviction_policy: str = "lru", host_slots: int = 0):
        page_size = as_int(page_size, "page_size")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if eviction_policy not in POLICIES:
            raise ValueError(
                f"unknown eviction policy {eviction_policy!r}; choose one of: {', '.join(POLICIES)}"
            )
        host_slots = as_size(host_slots, "host_slots")
        if host_slots + page_size > MAX_ID + 1:
            raise ValueError(f"host_slots must be <= {MAX_ID + 1 - page_size}, got {host_slots}")
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self.host_slots = host_slots
        self._next_id = 1
        self._reset_state()

    # ---------------------------------------------------------------- public API
    def reset(self) -> None:  # ids keep counting: pre-reset ids become stale
        self._reset_state()

    def match_prefix(self, tokens: Any, extra_key: str | None = None) -> tuple[np.ndarray, int]:
        key = self._page_aligned(as_index_array(tokens, "tokens"))
        ns = as_namespace(extra_key)
        self._clock += 1
        node, pos, values = self.root, 0, []
        while pos < len(key):
            step = self._step(node, ns, key, pos, device_only=True)
            if step is None:
                break
            child, n = step
            self._touch(child)
            values.append(child.value)
            node, pos = child, pos + n
        slots = np.concatenate(values) if values else EMPTY.copy()
        return slots, node.id

    def insert(
        self, tokens: Any, slots: Any, extra_key: str | None = None, priority: int = 0
    ) -> tuple[int, int]:
        tok = as_index_array(tokens, "tokens")
        val = as_index_array(slots, "slots")
        if len(tok) != len(val):
            raise ValueError(f"tokens and slots differ in length ({len(tok)} vs {len(val)})")
        for name, arr in (("tokens", tok), ("slots", val)):
            if len(arr) and (int(arr.min()) < 0 or int(arr.max()) > MAX_ID):
                raise ValueError(f"{name} must be in 0..{MAX_ID}")
        priority = as_int(priority, "priority")
        ns = as_namespace(extra_key)
        key = self._page_aligned(tok)
        self._clock += 1
        node, pos, cached_len = self.root, 0, None
        while pos < len(key):
            step = self._step(node, ns, key, pos)
            if step is None:
                break
            child, n = step
            child.hits += 1
            child.priority = max(child.priority, priority)
            self._touch(child)
            if child.value is None:  # host-only: it takes the caller's slots
                cached_len = pos if cached_len is None else cached_len
                self._set_device_value(child, val[pos : pos + n].copy())
            node, pos = child, pos + n
        cached_len = pos if cached_len is None else cached_len
        if pos < len(key):
            leaf = self._new_node(node, key[pos:].copy(), val[pos : len(key)].copy())
            leaf.access = leaf.creation = self._clock
            leaf.priority = priority
            leaf.ns = ns
            node.children[self._child_key(node, ns, key, pos)] = leaf
            node.num_device_children += 1
            self._evictable += len(leaf.key)
            self._refresh(node)
            self._refresh(leaf)
            node = leaf
        return cached_len, node.id

    def lock(self, node_id: int) -> None:
        node = self._get(node_id)
        if node is self.root:
            self._root_locks += 1
            return
        self._refresh_after(node, +1)

    def unlock(self, node_id: int) -> None:
        node = self._get(node_id)
        if node is self.root:
            if self._root_locks == 0:
                raise RuntimeError("unlock of the root, which is not locked")
            self._root_locks -= 1
            return
        if node.lock_ref == 0:
            raise RuntimeError(f"unlock of node {node_id}, which is not locked")
        self._refresh_after(node, -1)

    def evict(self, num_tokens: int) -> np.ndarray:
        freed, _, _ = self._evict_device(as_size(num_tokens, "num_tokens"), write_back=False)
        return freed

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def node_count(self) -> int:  # not counting the root
        return len(self._nodes) - 1

    # ---------------------------------------------------------------- internals
    def _reset_state(self) -> None:
        self.root = _Node(0, None, EMPTY, EMPTY)
        self._nodes: dict[int, _Node] = {0: self.root}
        self._leaves: set[int] = set()
        self._heap: list[tuple] = []
        self._host_leaves: set[int] = set()  # unlocked host-only nodes without children
        self._host_heap: list[tuple] = []
        self._host = PageAllocator(self.host_slots, self.page_size)
        self._evictable = 0
        self._protected = 0
        self._root_locks = 0
        self._clock = 0

    def _get(self, node_id: Any) -> _Node:
        node_id = as_int(node_id, "node_id")
        node = self._nodes.get(node_id)
        if node is None:
            raise ValueError(f"unknown or stale node id {node_id}")
        return node

    def _page_aligned(self, tokens: np.ndarray) -> np.ndarray:
        ps = self.page_size
        return tokens if ps == 1 else tokens[: len(tokens) // ps * ps]

    def _child_key(self, parent: _Node, ns: str | None, key: np.ndarray, pos: int):
        """Dict key of the child edge starting at key[pos]: its first page (+ namespace at root)."""
        page = int(key[pos]) if self.page_size == 1 else key[pos : pos + self.page_size].tobytes()
        return (ns, page) if parent is self.root else page

    def _step(self, node: _Node, ns: str | None, key: np.ndarray, pos: int, device_only=False):
        """(child, matched tokens): the child of `node` continuing key[pos:], split where the
        match ends inside it; None when there is none (with device_only: none on the device)."""
        child = node.children.get(self._child_key(node, ns, key, pos))
        if child is None or (device_only and child.value is None):
            return None
        n = self._common_len(child.key, key, pos)
        if n < len(child.key):
            child = self._split(child, n)
        return child, n

    def _common_len(self, node_key: np.ndarray, key: np.ndarray, pos: int) -> int:
        n = min(len(node_key), len(key) - pos)
        eq = node_key[:n] == key[pos : pos + n]
        m = n if eq.all() else int(np.argmin(eq))
        return m // self.page_size * self.page_size

    def _new_node(self, parent: _Node, key: np.ndarray, value: np.ndarray) -> _Node:
        node = _Node(self._next_id, parent, key, value)
        self._next_id += 1
        self._nodes[node.id] = node
        return node

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child` after n tokens; the new upper node takes its place. Returns it."""
        parent = child.parent
        assert parent is not None
        value = child.value
        upper = self._new_node(parent, child.key[:n], None if value is None else value[:n])
        for field in ("lock_ref", "access", "creation", "hits", "priority", "ns"):
            setattr(upper, field, getattr(child, field))
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:n], child.host_value[n:]
        upper.num_device_children = int(value is not None)
        child_key = self._child_key(parent, child.ns, child.key, 0)
        child.key, child.parent = child.key[n:], upper
        child.value = None if value is None else value[n:]
        upper.children[self._child_key(upper, child.ns, child.key, 0)] = child
        parent.children[child_key] = upper
        return upper

    def _touch(self, node: _Node) -> None:
        node.access = self._clock
        if node.id in self._leaves or node.id in self._host_leaves:
            self._refresh(node)

    def _refresh_after(self, node: _Node, delta: int) -> None:
        """Apply a lock delta on the path from node to the root and fix the candidate sets.

        Only device-resident tokens move between the ledgers; an ancestor can be a candidate
        too (when its children are not device-resident), so each 0 <-> 1 change refreshes."""
        walk: _Node | None = node
        while walk is not None and walk is not self.root:
            before = walk.lock_ref
            walk.lock_ref += delta
            if (before == 0) != (walk.lock_ref == 0):
                size = len(walk.key) if walk.value is not None else 0
                sign = 1 if before == 0 else -1
                self._evictable -= sign * size
                self._protected += sign * size
                if walk is not node:
                    self._refresh(walk)
            walk = walk.parent
        self._refresh(node)

    def _refresh(self, node: _Node) -> None:
        """Recompute node's status in both candidate sets and (re)queue it in its order."""
        if node is self.root:
            return
        node.version += 1
        unlocked, on_device = node.lock_ref == 0, node.value is not None
        for candidate, leaves, heap in (
            (unlocked and on_device and not node.num_device_children, self._leaves, self._heap),
            (unlocked and not on_device and not node.children, self._host_leaves, self._host_heap),
        ):
            if candidate:
                leaves.add(node.id)
                heapq.heappush(heap, (*self._order_key(node), node.id, node.version))
                self._maybe_compact(leaves, heap)
            else:
                leaves.discard(node.id)

    def _order_key(self, node: _Node) -> tuple[int, ...]:
        p = self.eviction_policy
        if p == "lru":
            return (node.access,)
        if p == "lfu":
            return (node.hits, node.access)
        if p == "fifo":
            return (node.creation,)
        return (node.priority, node.access)

    def _maybe_compact(self, leaves: set[int], heap: list[tuple]) -> None:
        if len(heap) > 2 * len(leaves) + 64:
            heap[:] = [
                (*self._order_key(n), n.id, n.version) for n in (self._nodes[i] for i in leaves)
            ]
            heapq.heapify(heap)
