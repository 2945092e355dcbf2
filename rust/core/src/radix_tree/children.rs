//! The child index: one hash map for every edge of the tree.
//!
//! An edge is found by (parent slot, hash of (namespace, first page of the child's key)); the
//! map holds the first child of that bucket and `Node::next_sibling` chains the (rare) others,
//! so a lookup always compares the real page and namespace and hash collisions cost a step,
//! never a wrong answer. All nodes under one root child share its namespace, so hashing the
//! namespace at every level is the same as the Python twin's "namespace at the root" key.
//! The index also keeps each parent's child list (`Node::first_child` and the
//! `next_child`/`prev_child` links), which `children_of` walks.

use super::node::{Node, NIL};
use crate::fxhash::{page_hash, FxHashMap};

pub(crate) struct ChildIndex {
    page_size: usize,
    heads: FxHashMap<u64, u32>,
}

#[inline]
fn bucket(parent: u32, ns: u32, page: &[u32]) -> u64 {
    (u64::from(parent) << 32) | u64::from(page_hash(ns, page))
}

impl ChildIndex {
    pub fn new(page_size: usize) -> Self {
        Self {
            page_size,
            heads: FxHashMap::default(),
        }
    }

    fn first_page<'a>(&self, node: &'a Node) -> &'a [u32] {
        &node.key()[..self.page_size]
    }

    fn bucket_of(&self, nodes: &[Node], child: u32) -> u64 {
        let node = &nodes[child as usize];
        bucket(node.parent, node.ns, self.first_page(node))
    }

    /// The child of `parent` whose key starts with `page` (exactly one page), if any.
    pub fn find(&self, nodes: &[Node], parent: u32, ns: u32, page: &[u32]) -> Option<u32> {
        let mut at = *self.heads.get(&bucket(parent, ns, page))?;
        while at != NIL {
            let node = &nodes[at as usize];
            if node.ns == ns && self.first_page(node) == page {
                return Some(at);
            }
            at = node.next_sibling;
        }
        None
    }

    /// File `child` under its parent (`child.parent` must be set).
    pub fn add(&mut self, nodes: &mut [Node], child: u32) {
        let key = self.bucket_of(nodes, child);
        let old = self.heads.insert(key, child).unwrap_or(NIL);
        nodes[child as usize].next_sibling = old;
        let parent = nodes[child as usize].parent;
        let first = nodes[parent as usize].first_child;
        if first != NIL {
            nodes[first as usize].prev_child = child;
        }
        let node = &mut nodes[child as usize];
        node.next_child = first;
        node.prev_child = NIL;
        let on_device = node.on_device;
        let parent = &mut nodes[parent as usize];
        parent.first_child = child;
        parent.num_children += 1;
        parent.num_device_children += u32::from(on_device);
    }

    /// Unfile `child` from its parent.
    pub fn remove(&mut self, nodes: &mut [Node], child: u32) {
        let key = self.bucket_of(nodes, child);
        let next = nodes[child as usize].next_sibling;
        self.relink(nodes, key, child, next);
        let node = &nodes[child as usize];
        let (parent, prev, next, on_device) = (
            node.parent,
            node.prev_child,
            node.next_child,
            node.on_device,
        );
        Self::set_child_link(nodes, parent, prev, next);
        if next != NIL {
            nodes[next as usize].prev_child = prev;
        }
        let parent = &mut nodes[parent as usize];
        parent.num_children -= 1;
        parent.num_device_children -= u32::from(on_device);
    }

    /// Make `parent`'s list continue after `prev` (NIL: at its head) with `to`.
    fn set_child_link(nodes: &mut [Node], parent: u32, prev: u32, to: u32) {
        if prev == NIL {
            nodes[parent as usize].first_child = to;
        } else {
            nodes[prev as usize].next_child = to;
        }
    }

    /// The children of `parent`, in no particular order.
    pub fn children_of(nodes: &[Node], parent: u32) -> Vec<u32> {
        let mut out = Vec::with_capacity(nodes[parent as usize].num_children as usize);
        let mut at = nodes[parent as usize].first_child;
        while at != NIL {
            out.push(at);
            at = nodes[at as usize].next_child;
        }
        out
    }

    /// Put `new` where `old` was filed (same parent, namespace and first page; `old` may have
    /// lost its tokens already, so the bucket comes from `new`).
    pub fn replace(&mut self, nodes: &mut [Node], old: u32, new: u32) {
        let key = self.bucket_of(nodes, new);
        nodes[new as usize].next_sibling = nodes[old as usize].next_sibling;
        self.relink(nodes, key, old, new);
        let old_node = &nodes[old as usize];
        let (parent, prev, next) = (old_node.parent, old_node.prev_child, old_node.next_child);
        Self::set_child_link(nodes, parent, prev, new);
        if next != NIL {
            nodes[next as usize].prev_child = new;
        }
        let node = &mut nodes[new as usize];
        node.prev_child = prev;
        node.next_child = next;
    }

    /// Make whatever pointed at `target` in bucket `key` point at `to` (NIL drops the link).
    fn relink(&mut self, nodes: &mut [Node], key: u64, target: u32, to: u32) {
        let Some(&head) = self.heads.get(&key) else {
            return;
        };
        if head == target {
            if to == NIL {
                self.heads.remove(&key);
            } else {
                self.heads.insert(key, to);
            }
            return;
        }
        let mut at = head;
        while at != NIL {
            let next = nodes[at as usize].next_sibling;
            if next == target {
                nodes[at as usize].next_sibling = to;
                return;
            }
            at = next;
        }
    }

    /// Number of filed edges (each live non-root node is one).
    pub fn count(&self, nodes: &[Node]) -> usize {
        self.heads
            .values()
            .map(|&head| {
                let mut n = 0;
                let mut at = head;
                while at != NIL {
                    n += 1;
                    at = nodes[at as usize].next_sibling;
                }
                n
            })
            .sum()
    }

    pub fn clear(&mut self) {
        self.heads = FxHashMap::default();
    }

    pub fn memory_bytes(&self) -> usize {
        super::node::map_bytes(&self.heads)
    }
}
