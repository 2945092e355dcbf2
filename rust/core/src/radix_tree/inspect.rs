//! Read-only views of the radix tree: DFS-weight order, the invariant check, pretty printing.

use std::cmp::Reverse;

use super::children::ChildIndex;
use super::node::{NIL, ROOT};
use super::RadixTree;
use crate::error::{broken, CoreResult};
use crate::fxhash::FxHashMap;

impl RadixTree {
    /// Positions of `node_ids` in DFS-weight order.
    ///
    /// weight(node) = requests ending at node + weights of its children. Children are visited by
    /// descending weight (ties: smaller id first); a node's own requests come after its subtree,
    /// in their given order.
    pub fn dfs_weight_order(&self, node_ids: &[i64]) -> CoreResult<Vec<usize>> {
        let mut group_of: FxHashMap<u32, usize> = FxHashMap::default();
        let mut groups: Vec<(u32, Vec<usize>)> = Vec::new();
        for (pos, &id) in node_ids.iter().enumerate() {
            let slot = self.slot(id)?;
            let g = *group_of.entry(slot).or_insert_with(|| {
                groups.push((slot, Vec::new()));
                groups.len() - 1
            });
            groups[g].1.push(pos);
        }
        let mut weight: FxHashMap<u32, usize> = FxHashMap::default();
        for (slot, positions) in &groups {
            let mut at = *slot;
            while at != NIL {
                *weight.entry(at).or_default() += positions.len();
                at = self.node(at).parent;
            }
        }
        let mut kids: FxHashMap<u32, Vec<u32>> = FxHashMap::default();
        for &slot in weight.keys() {
            if slot != ROOT {
                kids.entry(self.node(slot).parent).or_default().push(slot);
            }
        }
        let mut order = Vec::with_capacity(node_ids.len());
        let mut stack = vec![(ROOT, false)];
        while let Some((slot, expanded)) = stack.pop() {
            if expanded {
                if let Some(&g) = group_of.get(&slot) {
                    order.extend_from_slice(&groups[g].1);
                }
                continue;
            }
            stack.push((slot, true));
            if let Some(children) = kids.get_mut(&slot) {
                children.sort_by_key(|&c| (Reverse(weight[&c]), self.node(c).id));
                stack.extend(children.iter().rev().map(|&c| (c, false)));
            }
        }
        Ok(order)
    }

    /// Check every invariant; `CoreError::Invariant` names the first broken one.
    pub fn sanity_check(&self) -> CoreResult<()> {
        let nodes = &self.arena.nodes;
        let root = &nodes[ROOT as usize];
        if root.id != 0 || root.parent != NIL || root.len() != 0 {
            return broken("the root is malformed".into());
        }
        let mut kids: FxHashMap<u32, Vec<u32>> = FxHashMap::default();
        for (id, slot) in self.arena.id_slots() {
            let node = &nodes[slot as usize];
            if node.id != id || !node.is_live() || id >= self.next_id {
                return broken(format!("node {id} is registered at a wrong slot"));
            }
            if slot != ROOT {
                let parent = node.parent;
                if parent == NIL || !nodes.get(parent as usize).is_some_and(|p| p.is_live()) {
                    return broken(format!("node {id} has a missing parent"));
                }
                kids.entry(parent).or_default().push(slot);
            }
        }
        let (mut evictable, mut protected, mut leaves, mut seen) = (0, 0, 0, 0);
        let (mut host_leaves, mut host_slots) = (0, Vec::new());
        let mut root_children_per_ns = vec![0u32; self.namespaces.refcounts().len()];
        let mut stack = vec![ROOT];
        while let Some(slot) = stack.pop() {
            seen += 1;
            let node = &nodes[slot as usize];
            let children = kids.get(&slot).map_or(&[][..], Vec::as_slice);
            let mut listed = ChildIndex::children_of(nodes, slot);
            let mut filed = children.to_vec();
            listed.sort_unstable();
            filed.sort_unstable();
            if node.num_children as usize != children.len() || listed != filed {
                return broken(format!(
                    "node {} counts {} children, has {}",
                    node.id,
                    node.num_children,
                    children.len()
                ));
            }
            let device_children = children
                .iter()
                .filter(|&&c| nodes[c as usize].on_device)
                .count();
            if node.num_device_children as usize != device_children {
                return broken(format!(
                    "node {} counts {} device-resident children, has {device_children}",
                    node.id, node.num_device_children
                ));
            }
            if device_children > 0 && !node.on_device {
                return broken(format!(
                    "a child of node {} is on the device, it is not",
                    node.id
                ));
            }
            let mut child_locks = 0u64;
            for &c in children {
                let child = &nodes[c as usize];
                let page = &child.key()[..self.page_size.min(child.len())];
                if child.len() < self.page_size
                    || self.children.find(nodes, slot, child.ns, page) != Some(c)
                {
                    return broken(format!(
                        "node {} is filed under a wrong child key",
                        child.id
                    ));
                }
                if slot == ROOT {
                    match root_children_per_ns.get_mut(child.ns as usize) {
                        Some(n) => *n += 1,
                        None => {
                            return broken(format!("node {} has an unknown namespace", child.id))
                        }
                    }
                } else if child.ns != node.ns {
                    return broken(format!(
                        "node {} is in another namespace than its parent",
                        child.id
                    ));
                }
                child_locks += u64::from(child.lock_ref);
                stack.push(c);
            }
            if slot == ROOT {
                continue;
            }
            if node.len() == 0 || !node.len().is_multiple_of(self.page_size) {
                return broken(format!(
                    "node {} has a key of {} tokens",
                    node.id,
                    node.len()
                ));
            }
            if u64::from(node.lock_ref) < child_locks {
                return broken(format!(
                    "node {} lock_ref {} < children's {child_locks}",
                    node.id, node.lock_ref
                ));
            }
            if !node.on_device && !node.on_host {
                return broken(format!(
                    "node {} has neither device nor host slots",
                    node.id
                ));
            }
            host_slots.extend_from_slice(node.host_value());
            let unlocked = node.lock_ref == 0;
            let evictable_leaf = unlocked && node.on_device && device_children == 0;
            let host_leaf = unlocked && !node.on_device && children.is_empty();
            if node.on_device && node.lock_ref > 0 {
                protected += node.len();
            } else if node.on_device {
                evictable += node.len();
            }
            leaves += usize::from(evictable_leaf);
            host_leaves += usize::from(host_leaf);
            if evictable_leaf != node.in_leaves || evictable_leaf != self.leaves.contains(node) {
                return broken("the evictable-leaf set is out of date".into());
            }
            if host_leaf != node.in_host_leaves || host_leaf != self.host_leaves.contains(node) {
                return broken("the host-leaf set is out of date".into());
            }
        }
        if seen != self.arena.live_count() {
            return broken(format!(
                "{} registered nodes are unreachable",
                self.arena.live_count() - seen
            ));
        }
        if (evictable, protected) != (self.evictable, self.protected) {
            return broken(format!(
                "size ledger says evictable={} protected={}, the tree holds {evictable} and {protected}",
                self.evictable, self.protected
            ));
        }
        if leaves != self.leaves.len() {
            return broken(format!(
                "the eviction order holds {} entries for {leaves} leaves",
                self.leaves.len()
            ));
        }
        if host_leaves != self.host_leaves.len() {
            return broken(format!(
                "the host eviction order holds {} entries for {host_leaves} host leaves",
                self.host_leaves.len()
            ));
        }
        self.check_host_slots(host_slots)?;
        let edges = self.children.count(nodes);
        if edges != seen - 1 {
            return broken(format!(
                "the child index holds {edges} edges for {} nodes",
                seen - 1
            ));
        }
        let refs = self.namespaces.refcounts();
        let named = refs.iter().skip(1).filter(|&&n| n > 0).count();
        if refs
            .iter()
            .zip(&root_children_per_ns)
            .skip(1)
            .any(|(a, b)| a != b)
            || named != self.namespaces.len()
        {
            return broken("the namespace table is out of date".into());
        }
        Ok(())
    }

    /// Every allocated host slot is owned by exactly one node, and no free one is.
    fn check_host_slots(&self, mut owned: Vec<u32>) -> CoreResult<()> {
        owned.sort_unstable();
        if owned.windows(2).any(|w| w[0] == w[1]) {
            return broken("a host slot is owned by two nodes".into());
        }
        if owned.len() != self.host_used_size() {
            return broken(format!(
                "nodes own {} host slots, the host allocator has {} in use",
                owned.len(),
                self.host_used_size()
            ));
        }
        if owned.iter().any(|&s| !self.host.is_allocated(u64::from(s))) {
            return broken("a node owns a host slot that is free".into());
        }
        Ok(())
    }

    /// One line per node, depth-first, children by ascending id, then `#tokens: N`.
    pub fn pretty_print(&self) -> String {
        let nodes = &self.arena.nodes;
        let mut kids: FxHashMap<u32, Vec<u32>> = FxHashMap::default();
        for (_, slot) in self.arena.id_slots() {
            if slot != ROOT {
                kids.entry(nodes[slot as usize].parent)
                    .or_default()
                    .push(slot);
            }
        }
        let mut lines = Vec::with_capacity(self.arena.live_count() + 1);
        let mut stack = vec![(ROOT, 0usize)];
        while let Some((slot, depth)) = stack.pop() {
            let node = &nodes[slot as usize];
            let head: Vec<String> = node.key().iter().take(10).map(u32::to_string).collect();
            // Only nodes with a host value say so: a tree without a host tier prints as before.
            let residency = match (node.on_host, node.on_device) {
                (false, _) => "",
                (true, true) => " [host]",
                (true, false) => " [host only]",
            };
            lines.push(format!(
                "{}[{}] len={} lock={} {}{residency}",
                "  ".repeat(depth),
                node.id,
                node.len(),
                node.lock_ref,
                head.join(" ")
            ));
            if let Some(children) = kids.get_mut(&slot) {
                children.sort_by_key(|&c| Reverse(nodes[c as usize].id));
                stack.extend(children.iter().map(|&c| (c, depth + 1)));
            }
        }
        lines.push(format!("#tokens: {}", self.total_size()));
        lines.join("\n")
    }
}
