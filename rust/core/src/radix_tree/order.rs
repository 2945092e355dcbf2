//! The eviction order: evictable leaves (unlocked, no children) sorted by the policy's key.
//!
//! Smallest first: lru (access, id); lfu (hits, access, id); fifo (creation, id); priority
//! (priority, access, id). The set is updated on every change of a leaf's status or key, so
//! `evict` never walks the tree.

use std::collections::BTreeSet;

use super::node::Node;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictionPolicy {
    Lru,
    Lfu,
    Fifo,
    Priority,
}

impl EvictionPolicy {
    pub const NAMES: [&'static str; 4] = ["lru", "lfu", "fifo", "priority"];

    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "lru" => Some(Self::Lru),
            "lfu" => Some(Self::Lfu),
            "fifo" => Some(Self::Fifo),
            "priority" => Some(Self::Priority),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

/// (major, minor, node id): the id breaks ties and makes every key unique.
pub(crate) type OrderKey = (u64, u64, u64);

pub(crate) struct LeafOrder {
    policy: EvictionPolicy,
    set: BTreeSet<OrderKey>,
}

impl LeafOrder {
    pub fn new(policy: EvictionPolicy) -> Self {
        Self {
            policy,
            set: BTreeSet::new(),
        }
    }

    pub fn policy(&self) -> EvictionPolicy {
        self.policy
    }

    pub fn key(&self, node: &Node) -> OrderKey {
        // Flipping the sign bit maps i64 onto u64 in the same order.
        let priority = (node.priority as u64) ^ (1 << 63);
        match self.policy {
            EvictionPolicy::Lru => (node.access, 0, node.id),
            EvictionPolicy::Lfu => (node.hits, node.access, node.id),
            EvictionPolicy::Fifo => (node.creation, 0, node.id),
            EvictionPolicy::Priority => (priority, node.access, node.id),
        }
    }

    pub fn insert(&mut self, node: &Node) {
        self.set.insert(self.key(node));
    }

    pub fn remove(&mut self, node: &Node) {
        self.set.remove(&self.key(node));
    }

    pub fn contains(&self, node: &Node) -> bool {
        self.set.contains(&self.key(node))
    }

    /// The id of the next leaf to evict, removed from the order.
    pub fn pop_first(&mut self) -> Option<u64> {
        self.set.pop_first().map(|(_, _, id)| id)
    }

    pub fn len(&self) -> usize {
        self.set.len()
    }

    pub fn clear(&mut self) {
        self.set.clear();
    }

    pub fn memory_bytes(&self) -> usize {
        // std's B-tree nodes hold up to 11 keys and run about 2/3 full: ~1.6x the key bytes.
        self.set.len() * std::mem::size_of::<OrderKey>() * 8 / 5
    }
}
