"""InspectMixin: read-only views of the radix tree: invariants, DFS-weight order, printing.

Part of `RadixTree` (radix_tree.py holds the contract); `rust/core/src/radix_tree/inspect.rs`
is its twin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from sglite.core._arrays import EMPTY, as_int

if TYPE_CHECKING:
    from sglite.core.radix_tree import _Node

NODE_OVERHEAD_BYTES = 200  # rough per-node Python object cost, for memory_bytes()


def _nbytes(value: np.ndarray | None) -> int:
    return 0 if value is None else value.nbytes


def _residency(node: _Node) -> str:
    """Printed only with a host value, so a tree without a host tier prints as before."""
    if node.host_value is None:
        return ""
    return " [host]" if node.value is not None else " [host only]"


class InspectMixin:
    """Read-only views of RadixTree."""

    def memory_bytes(self) -> int:
        """Approximate bytes held by the tree (keys, values and per-node overhead)."""
        return sum(
            n.key.nbytes + _nbytes(n.value) + _nbytes(n.host_value) + NODE_OVERHEAD_BYTES
            for n in self._nodes.values()
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
        host_leaves: set[int] = set()
        host_slots: list[np.ndarray] = []
        seen = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            seen += 1
            if self._nodes.get(node.id) is not node:
                raise RuntimeError(f"node {node.id} is reachable but not registered")
            child_locks = device_children = 0
            for k, child in node.children.items():
                if child.parent is not node:
                    raise RuntimeError(f"node {child.id} has a wrong parent")
                if self._child_key(node, child.ns, child.key, 0) != k:
                    raise RuntimeError(f"node {child.id} is filed under a wrong child key")
                if child.value is not None and node.value is None:
                    raise RuntimeError(f"node {child.id} is on the device, its parent is not")
                child_locks += child.lock_ref
                device_children += child.value is not None
                stack.append(child)
            if node.num_device_children != device_children:
                raise RuntimeError(
                    f"node {node.id} counts {node.num_device_children} device-resident "
                    f"children, has {device_children}"
                )
            if node is self.root:
                continue
            if len(node.key) == 0 or len(node.key) % self.page_size:
                raise RuntimeError(f"node {node.id} has a key of {len(node.key)} tokens")
            if node.value is None and node.host_value is None:
                raise RuntimeError(f"node {node.id} has neither device nor host slots")
            for name, value in (("device", node.value), ("host", node.host_value)):
                if value is not None and len(value) != len(node.key):
                    raise RuntimeError(
                        f"node {node.id} has {len(value)} {name} slots for {len(node.key)} tokens"
                    )
            if node.host_value is not None:
                host_slots.append(node.host_value)
            if node.lock_ref < child_locks:
                raise RuntimeError(
                    f"node {node.id} lock_ref {node.lock_ref} < children's {child_locks}"
                )
            if node.value is None:
                if not node.lock_ref and not node.children:
                    host_leaves.add(node.id)
            elif node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if not device_children:
                    leaves.add(node.id)
        if seen != len(self._nodes):
            raise RuntimeError(f"{len(self._nodes) - seen} registered nodes are unreachable")
        if (evictable, protected) != (self._evictable, self._protected):
            raise RuntimeError(
                f"size ledger says evictable={self._evictable} protected={self._protected}, "
                f"the tree holds {evictable} and {protected}"
            )
        self._check_host_slots(np.concatenate(host_slots) if host_slots else EMPTY)
        for name, found, kept, heap in (
            ("evictable-leaf", leaves, self._leaves, self._heap),
            ("host-leaf", host_leaves, self._host_leaves, self._host_heap),
        ):
            if found != kept:
                raise RuntimeError(f"the {name} set is out of date")
            live = {(nid, ver) for *_, nid, ver in heap}
            if any((nid, self._nodes[nid].version) not in live for nid in found):
                raise RuntimeError(f"a {name} candidate is missing from its eviction order")

    def _check_host_slots(self, owned: np.ndarray) -> None:
        """Every allocated host slot is owned by exactly one node, and no free one is."""
        host, ps = self._host, self.page_size
        if len(np.unique(owned)) != len(owned):
            raise RuntimeError("a host slot is owned by two nodes")
        if len(owned) != host.capacity() - host.available_size():
            raise RuntimeError(
                f"nodes own {len(owned)} host slots, the host allocator has "
                f"{host.capacity() - host.available_size()} in use"
            )
        if len(owned) and (
            int(owned.min()) < ps or host._is_free[owned // ps].any()  # noqa: SLF001
        ):
            raise RuntimeError("a node owns a host slot that is free")

    def pretty_print(self) -> str:
        lines: list[str] = []
        stack: list[tuple[_Node, int]] = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            head = " ".join(str(int(t)) for t in node.key[:10])
            lines.append(
                f"{'  ' * depth}[{node.id}] len={len(node.key)} lock={node.lock_ref} {head}"
                + _residency(node)
            )
            for child in sorted(node.children.values(), key=lambda c: c.id, reverse=True):
                stack.append((child, depth + 1))
        lines.append(f"#tokens: {self.total_size()}")
        return "\n".join(lines)
