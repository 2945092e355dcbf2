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
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from sglite.core._arrays import EMPTY, as_index_array, as_int, as_namespace, as_size

POLICIES = ("lru", "lfu", "fifo", "priority")
MAX_ID = 2**32 - 2  # token ids and slots are stored as u32 by the Rust core
NODE_OVERHEAD_BYTES = 200  # rough per-node Python object cost, for memory_bytes()


class _Node:
    __slots__ = (
        "id", "parent", "key", "value", "children", "lock_ref",
        "access", "creation", "hits", "priority", "version", "ns",
    )  # fmt: skip

    def __init__(self, node_id: int, parent: _Node | None, key: np.ndarray, value: np.ndarray):
        self.id = node_id
        self.parent = parent
        self.key = key
        self.value = value
        self.children: dict[Any, _Node] = {}
        self.lock_ref = 0
        self.access = 0
        self.creation = 0
        self.hits = 1
        self.priority = 0
        self.version = 0
        self.ns: str | None = None  # namespace (extra_key); the edge key uses it at the root


class RadixTree:
    """Prefix cache index. See the module docstring for the full contract."""

    def __init__(self, page_size: int = 1, eviction_policy: str = "lru"):
        page_size = as_int(page_size, "page_size")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if eviction_policy not in POLICIES:
            raise ValueError(
                f"unknown eviction policy {eviction_policy!r}; choose one of: {', '.join(POLICIES)}"
            )
        self.page_size = page_size
        self.eviction_policy = eviction_policy
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
            child = node.children.get(self._child_key(node, ns, key, pos))
            if child is None:
                break
            n = self._common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
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
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self._child_key(node, ns, key, pos))
            if child is None:
                break
            n = self._common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.hits += 1
            child.priority = max(child.priority, priority)
            self._touch(child)
            node, pos = child, pos + n
        cached_len = pos
        if pos < len(key):
            leaf = self._new_node(node, key[pos:].copy(), val[pos : len(key)].copy())
            leaf.access = leaf.creation = self._clock
            leaf.priority = priority
            leaf.ns = ns
            node.children[self._child_key(node, ns, key, pos)] = leaf
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
        num_tokens = as_size(num_tokens, "num_tokens")
        freed: list[np.ndarray] = []
        num_freed = 0
        while num_freed < num_tokens and self._heap:
            *_, node_id, version = heapq.heappop(self._heap)
            node = self._nodes.get(node_id)
            if node is None or node.version != version or node_id not in self._leaves:
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(parent, node.ns, node.key, 0)]
            del self._nodes[node_id]
            self._leaves.discard(node_id)
            self._evictable -= len(node.key)
            freed.append(node.value)
            num_freed += len(node.value)
            self._refresh(parent)
        return np.concatenate(freed) if freed else EMPTY.copy()

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def node_count(self) -> int:  # not counting the root
        return len(self._nodes) - 1

    def memory_bytes(self) -> int:
        """Approximate bytes held by the tree (keys, values and per-node overhead)."""
        return sum(
            n.key.nbytes + n.value.nbytes + NODE_OVERHEAD_BYTES for n in self._nodes.values()
        )

    def dfs_weight_order(self, node_ids: Any) -> list[int]:
        """Positions of `node_ids` in DFS-weight order.

        weight(node) = requests ending at node + weights of its children. Children are visited
        by descending weight (ties: smaller id first); a node's own requests come after its
        subtree, in their given order.
        """
        ids = [as_int(x, "node_ids[]") for x in node_ids]
        at_node: dict[int, list[int]] = {}
        for pos, node_id in enumerate(ids):
            self._get(node_id)
            at_node.setdefault(node_id, []).append(pos)
        weight: dict[int, int] = {}
        kids: dict[int, list[int]] = {}
        for node_id, positions in at_node.items():
            node: _Node | None = self._nodes[node_id]
            while node is not None:
                weight[node.id] = weight.get(node.id, 0) + len(positions)
                node = node.parent
        for node_id in weight:
            parent = self._nodes[node_id].parent
            if parent is not None:
                kids.setdefault(parent.id, []).append(node_id)
        order: list[int] = []
        stack: list[tuple[int, bool]] = [(0, False)]
        while stack:
            node_id, expanded = stack.pop()
            if expanded:
                order.extend(at_node.get(node_id, ()))
                continue
            stack.append((node_id, True))
            children = sorted(kids.get(node_id, ()), key=lambda c: (-weight[c], c))
            stack.extend((c, False) for c in reversed(children))
        return order

    def sanity_check(self) -> None:
        """Raise RuntimeError on any broken invariant."""
        evictable = protected = 0
        leaves: set[int] = set()
        seen = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            seen += 1
            if self._nodes.get(node.id) is not node:
                raise RuntimeError(f"node {node.id} is reachable but not registered")
            child_locks = 0
            for k, child in node.children.items():
                if child.parent is not node:
                    raise RuntimeError(f"node {child.id} has a wrong parent")
                if self._child_key(node, child.ns, child.key, 0) != k:
                    raise RuntimeError(f"node {child.id} is filed under a wrong child key")
                child_locks += child.lock_ref
                stack.append(child)
            if node is self.root:
                continue
            if len(node.key) == 0 or len(node.key) % self.page_size:
                raise RuntimeError(f"node {node.id} has a key of {len(node.key)} tokens")
            if len(node.value) != len(node.key):
                raise RuntimeError(
                    f"node {node.id} has {len(node.value)} slots for {len(node.key)} tokens"
                )
            if node.lock_ref < child_locks:
                raise RuntimeError(
                    f"node {node.id} lock_ref {node.lock_ref} < children's {child_locks}"
                )
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if not node.children:
                    leaves.add(node.id)
        if seen != len(self._nodes):
            raise RuntimeError(f"{len(self._nodes) - seen} registered nodes are unreachable")
        if (evictable, protected) != (self._evictable, self._protected):
            raise RuntimeError(
                f"size ledger says evictable={self._evictable} protected={self._protected}, "
                f"the tree holds {evictable} and {protected}"
            )
        if leaves != self._leaves:
            raise RuntimeError("the evictable-leaf set is out of date")
        live = {(nid, ver) for *_, nid, ver in self._heap}
        if any((nid, self._nodes[nid].version) not in live for nid in leaves):
            raise RuntimeError("an evictable leaf is missing from the eviction order")

    def pretty_print(self) -> str:
        lines: list[str] = []
        stack: list[tuple[_Node, int]] = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            head = " ".join(str(int(t)) for t in node.key[:10])
            lines.append(
                f"{'  ' * depth}[{node.id}] len={len(node.key)} lock={node.lock_ref} {head}"
            )
            for child in sorted(node.children.values(), key=lambda c: c.id, reverse=True):
                stack.append((child, depth + 1))
        lines.append(f"#tokens: {self.total_size()}")
        return "\n".join(lines)

    # ---------------------------------------------------------------- internals
    def _reset_state(self) -> None:
        self.root = _Node(0, None, EMPTY, EMPTY)
        self._nodes: dict[int, _Node] = {0: self.root}
        self._leaves: set[int] = set()
        self._heap: list[tuple] = []
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
        upper = self._new_node(parent, child.key[:n], child.value[:n])
        for field in ("lock_ref", "access", "creation", "hits", "priority", "ns"):
            setattr(upper, field, getattr(child, field))
        child_key = self._child_key(parent, child.ns, child.key, 0)
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._child_key(upper, child.ns, child.key, 0)] = child
        parent.children[child_key] = upper
        return upper

    def _touch(self, node: _Node) -> None:
        node.access = self._clock
        if node.id in self._leaves:
            self._refresh(node)

    def _refresh_after(self, node: _Node, delta: int) -> None:
        """Apply a lock delta on the path from node to the root, then fix node's leaf status."""
        walk: _Node | None = node
        while walk is not None and walk is not self.root:
            before = walk.lock_ref
            walk.lock_ref += delta
            if before == 0 and walk.lock_ref == 1:
                self._evictable -= len(walk.key)
                self._protected += len(walk.key)
            elif before == 1 and walk.lock_ref == 0:
                self._protected -= len(walk.key)
                self._evictable += len(walk.key)
            walk = walk.parent
        self._refresh(node)

    def _refresh(self, node: _Node) -> None:
        """Recompute node's evictable-leaf status and (re)queue it in the eviction order."""
        if node is self.root:
            return
        node.version += 1
        if node.lock_ref == 0 and not node.children:
            self._leaves.add(node.id)
            heapq.heappush(self._heap, (*self._order_key(node), node.id, node.version))
            self._maybe_compact()
        else:
            self._leaves.discard(node.id)

    def _order_key(self, node: _Node) -> tuple[int, ...]:
        p = self.eviction_policy
        if p == "lru":
            return (node.access,)
        if p == "lfu":
            return (node.hits, node.access)
        if p == "fifo":
            return (node.creation,)
        return (node.priority, node.access)

    def _maybe_compact(self) -> None:
        if len(self._heap) > 2 * len(self._leaves) + 64:
            self._heap = [
                (*self._order_key(n), n.id, n.version)
                for n in (self._nodes[i] for i in self._leaves)
            ]
            heapq.heapify(self._heap)
