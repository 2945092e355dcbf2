//! RadixTree: the prefix-cache index, token ids -> KV slots (twin of `radix_tree.py`).
//!
//! Contract (the Python twin's module docstring is the full text):
//! - Keys match in whole pages; a node is split where a match or an insert ends inside it.
//!   `extra_key` namespaces the key; equal tokens under different keys never share nodes.
//! - Node ids: root 0, then 1, 2, ... in creation order, never reused (not even after `reset`).
//! - Time is a logical clock, one tick per `match_prefix` / `insert`; every node on the walked
//!   path gets the tick. A split's upper half takes the tick, the lower half keeps its time.
//! - Locks count references along the path to the root; sizes move between evictable and
//!   protected on 0 <-> 1 transitions. Locking the root only counts.
//! - `evict` removes unlocked leaves in policy order (see `order.rs`); the order is kept
//!   incrementally. hit_count: 1 at creation, +1 per insert walking through; priority: an insert
//!   raises every node it walks to max(old, priority).
//!
//! Host tier (HiCache; `tiers.rs`, twin of `radix_tiers.py`): with `host_slots` > 0 a node has a
//! device value and/or a host value (slots of an internal host `PageAllocator`); device-resident
//! nodes form the top of the tree. The ledgers count device-resident tokens; `match_prefix`
//! stops at the first host-only node; device eviction takes unlocked device-resident nodes with
//! no device-resident child; host eviction unlocked host-only nodes without children; `insert`
//! gives host-only nodes on its path the caller's slots. With `host_slots == 0` none of this
//! shows.
//!
//! Tokens and slots are stored as u32 (8 bytes per cached token with its slot); callers pass
//! u32, i32 or i64 ids (`CompactId`). An id the tree cannot hold never matches and cannot be
//! inserted.

mod children;
mod ids;
mod inspect;
mod locks;
mod namespaces;
mod node;
mod order;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_tiers;
mod tiers;

use children::ChildIndex;
use ids::common_len;
pub use ids::{check_ids, CompactId};
use namespaces::Namespaces;
use node::{Arena, Node, NIL, ROOT};
pub use order::EvictionPolicy;
use order::LeafOrder;

use crate::error::{bad, CoreError, CoreResult};
use crate::PageAllocator;

pub struct RadixTree {
    page_size: usize,
    arena: Arena,
    children: ChildIndex,
    leaves: LeafOrder,
    /// Host-only nodes that host eviction may take (unlocked, no children).
    host_leaves: LeafOrder,
    host: PageAllocator,
    host_slots: i64,
    namespaces: Namespaces,
    next_id: u64,
    clock: u64,
    evictable: usize,
    protected: usize,
    root_locks: u64,
    /// Scratch: the nodes of the last walk (reused to avoid an allocation per call).
    path: Vec<u32>,
}

impl RadixTree {
    pub fn new(page_size: i64, policy: EvictionPolicy) -> CoreResult<Self> {
        Self::with_host(page_size, policy, 0)
    }

    /// A tree with a host tier of `host_slots` slots (0: none).
    pub fn with_host(page_size: i64, policy: EvictionPolicy, host_slots: i64) -> CoreResult<Self> {
        let ps = crate::check_page_size(page_size)?;
        let max = i64::from(crate::NO_TOKEN) - page_size;
        if !(0..=max).contains(&host_slots) {
            return bad(format!("host_slots must be in 0..={max}, got {host_slots}"));
        }
        Ok(Self {
            page_size: ps,
            arena: Arena::new(),
            children: ChildIndex::new(ps),
            leaves: LeafOrder::new(policy),
            host_leaves: LeafOrder::new(policy),
            host: PageAllocator::new(host_slots, page_size)?,
            host_slots,
            namespaces: Namespaces::new(),
            next_id: 1,
            clock: 0,
            evictable: 0,
            protected: 0,
            root_locks: 0,
            path: Vec::new(),
        })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn eviction_policy(&self) -> EvictionPolicy {
        self.leaves.policy()
    }

    /// Drop every node; ids keep counting, so pre-reset ids become stale.
    pub fn reset(&mut self) {
        self.arena = Arena::new();
        self.children.clear();
        self.leaves.clear();
        self.host_leaves.clear();
        if let Ok(host) = PageAllocator::new(self.host_slots, self.page_size as i64) {
            self.host = host;
        }
        self.namespaces = Namespaces::new();
        self.clock = 0;
        self.evictable = 0;
        self.protected = 0;
        self.root_locks = 0;
    }

    /// Longest cached prefix in whole pages: (its slots, the last matched node id). Ids the
    /// tree cannot hold (`NO_TOKEN`) simply do not match.
    pub fn match_prefix<T: CompactId>(
        &mut self,
        tokens: &[T],
        extra_key: Option<&str>,
    ) -> (Vec<i64>, u64) {
        let key = self.page_aligned(tokens);
        let ns = self.namespaces.lookup(extra_key);
        self.clock += 1;
        let mut path = std::mem::take(&mut self.path);
        let (last, matched) = self.walk(key, ns, None, true, &mut path);
        let mut slots = Vec::with_capacity(matched);
        for &slot in &path {
            slots.extend(self.node(slot).value().iter().map(|&v| i64::from(v)));
        }
        path.clear();
        self.path = path;
        (slots, self.node(last).id)
    }

    /// Insert the page-aligned prefix of `tokens`: (tokens already cached, last node id).
    /// Every token and slot must be below `NO_TOKEN`; on error nothing changes.
    pub fn insert<T: CompactId, S: CompactId>(
        &mut self,
        tokens: &[T],
        slots: &[S],
        extra_key: Option<&str>,
        priority: i64,
    ) -> CoreResult<(usize, u64)> {
        if tokens.len() != slots.len() {
            return bad(format!(
                "tokens and slots differ in length ({} vs {})",
                tokens.len(),
                slots.len()
            ));
        }
        check_ids(tokens, "tokens")?;
        check_ids(slots, "slots")?;
        let key = self.page_aligned(tokens);
        let ns = self.namespaces.lookup(extra_key);
        self.clock += 1;
        let mut path = std::mem::take(&mut self.path);
        let (mut last, walked) = self.walk(key, ns, Some(priority), false, &mut path);
        let cached_len = self.take_slots_on_host_only(&path, slots, walked);
        path.clear();
        self.path = path;
        if walked < key.len() {
            // An unknown namespace stops the walk at the root: intern it for the new root child.
            let ns = ns.unwrap_or_else(|| self.namespaces.intern(extra_key));
            let mut data = Vec::with_capacity(2 * (key.len() - walked));
            data.extend(key[walked..].iter().map(|t| t.compact()));
            data.extend(slots[walked..key.len()].iter().map(|s| s.compact()));
            let mut leaf = Node::new(self.next_id, last, ns, data);
            self.next_id += 1;
            leaf.access = self.clock;
            leaf.creation = self.clock;
            leaf.priority = priority;
            let len = leaf.len();
            let leaf = self.arena.alloc(leaf);
            self.children.add(&mut self.arena.nodes, leaf);
            if last == ROOT {
                self.namespaces.retain(ns);
            }
            self.evictable += len;
            self.refresh(last);
            self.refresh(leaf);
            last = leaf;
        }
        Ok((cached_len, self.node(last).id))
    }

    /// Device eviction in policy order until at least `num_tokens` are freed or no candidate is
    /// left; returns the freed slots in eviction order. A candidate with a host value stays as
    /// a host-only node; one without is deleted with its host-only descendants.
    pub fn evict(&mut self, num_tokens: usize) -> Vec<i64> {
        self.evict_device(num_tokens, false).0
    }

    pub fn evictable_size(&self) -> usize {
        self.evictable
    }

    pub fn protected_size(&self) -> usize {
        self.protected
    }

    pub fn total_size(&self) -> usize {
        self.evictable + self.protected
    }

    /// Number of nodes, not counting the root.
    pub fn node_count(&self) -> usize {
        self.arena.live_count() - 1
    }

    /// Bytes held by the tree: node structs, token/slot blocks, the index maps, the order.
    pub fn memory_bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.arena.memory_bytes()
            + self.children.memory_bytes()
            + self.leaves.memory_bytes()
            + self.host_leaves.memory_bytes()
            + self.host.memory_bytes()
            + self.namespaces.memory_bytes()
            + self.path.capacity() * 4
    }

    // ------------------------------------------------------------------ internals
    #[inline]
    fn node(&self, slot: u32) -> &Node {
        &self.arena.nodes[slot as usize]
    }

    #[inline]
    fn node_mut(&mut self, slot: u32) -> &mut Node {
        &mut self.arena.nodes[slot as usize]
    }

    fn slot(&self, node_id: i64) -> CoreResult<u32> {
        u64::try_from(node_id)
            .ok()
            .and_then(|id| self.arena.slot(id))
            .ok_or_else(|| CoreError::BadArgument(format!("unknown or stale node id {node_id}")))
    }

    fn page_aligned<'a, T>(&self, tokens: &'a [T]) -> &'a [T] {
        &tokens[..tokens.len() / self.page_size * self.page_size]
    }

    /// Walk down from the root along `key`, splitting where the match ends inside a node and
    /// stamping each visited node (plus hits/priority when `insert_priority` is given).
    /// Returns (last node, matched length); `path` gets the visited nodes.
    fn walk<T: CompactId>(
        &mut self,
        key: &[T],
        ns: Option<u32>,
        insert_priority: Option<i64>,
        stop_at_host: bool,
        path: &mut Vec<u32>,
    ) -> (u32, usize) {
        let Some(ns) = ns else { return (ROOT, 0) };
        let ps = self.page_size;
        let (mut small, mut large) = ([0u32; 64], Vec::new());
        let page: &mut [u32] = if ps <= small.len() {
            &mut small[..ps]
        } else {
            large.resize(ps, 0);
            &mut large
        };
        let (mut node, mut pos) = (ROOT, 0);
        while pos < key.len() {
            for (p, t) in page.iter_mut().zip(&key[pos..pos + ps]) {
                *p = t.compact();
            }
            let Some(child) = self.children.find(&self.arena.nodes, node, ns, page) else {
                break;
            };
            let child_node = self.node(child);
            if stop_at_host && !child_node.on_device {
                break;
            }
            let n = common_len(child_node.key(), &key[pos..]) / ps * ps;
            let child = if n < child_node.len() {
                self.split(child, n)
            } else {
                child
            };
            self.visit(child, insert_priority);
            path.push(child);
            node = child;
            pos += n;
        }
        (node, pos)
    }

    fn visit(&mut self, slot: u32, insert_priority: Option<i64>) {
        let (in_leaves, in_host_leaves) =
            (self.node(slot).in_leaves, self.node(slot).in_host_leaves);
        if in_leaves {
            self.leaves.remove(&self.arena.nodes[slot as usize]);
        }
        if in_host_leaves {
            self.host_leaves.remove(&self.arena.nodes[slot as usize]);
        }
        let clock = self.clock;
        let node = self.node_mut(slot);
        if let Some(priority) = insert_priority {
            node.hits += 1;
            node.priority = node.priority.max(priority);
        }
        node.access = clock;
        if in_leaves {
            self.leaves.insert(&self.arena.nodes[slot as usize]);
        }
        if in_host_leaves {
            self.host_leaves.insert(&self.arena.nodes[slot as usize]);
        }
    }

    /// Cut `child` after n tokens; a new upper node (a fresh id) takes its place. Returns it.
    fn split(&mut self, child: u32, n: usize) -> u32 {
        let front = self.node_mut(child).split_off_front(n);
        let id = self.next_id;
        self.next_id += 1;
        let old = self.node(child);
        let mut upper = Node::new(id, old.parent, old.ns, front);
        upper.lock_ref = old.lock_ref;
        upper.access = old.access;
        upper.creation = old.creation;
        upper.hits = old.hits;
        upper.priority = old.priority;
        upper.on_device = old.on_device;
        upper.on_host = old.on_host;
        let upper = self.arena.alloc(upper);
        // The upper half has the same parent, namespace and first page: it takes child's edge.
        self.children.replace(&mut self.arena.nodes, child, upper);
        let lower = self.node_mut(child);
        lower.parent = upper;
        lower.next_sibling = NIL;
        self.children.add(&mut self.arena.nodes, child);
        upper
    }
}
