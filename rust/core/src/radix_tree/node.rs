//! Node storage of the radix tree: a slot arena plus an id -> slot map.
//!
//! Node ids are public and never reused (root 0, then 1, 2, ... in creation order); arena slots
//! are private and recycled, so the arena stays as large as the live tree, not its history.
//! A node's tokens and slot values share one exactly-sized allocation (u32 each, 8 bytes per
//! cached token): `data = key ++ value ++ host_value`, where the device value is present when
//! `on_device` and the host value when `on_host` (at least one of them, except for the root).
//! Each node also links its children in a doubly linked list (`first_child`, `next_child`,
//! `prev_child`), so a subtree can be walked without scanning the arena.

use crate::fxhash::FxHashMap;

/// "No node" in parent / sibling links.
pub(crate) const NIL: u32 = u32::MAX;
/// The root's arena slot (its id is 0 as well).
pub(crate) const ROOT: u32 = 0;
const DEAD: u64 = u64::MAX;
/// What the system allocator adds to each heap block (glibc: an 8-byte header, 16-byte rounding).
const ALLOC_OVERHEAD: usize = 16;

pub(crate) struct Node {
    pub id: u64,
    pub parent: u32,
    /// Next child of the same parent in the same child-index bucket (hash collision chain).
    pub next_sibling: u32,
    /// Interned extra_key namespace; 0 is "no namespace".
    pub ns: u32,
    pub lock_ref: u32,
    pub num_children: u32,
    /// Children that are device-resident (a node is a device candidate when it has none).
    pub num_device_children: u32,
    pub first_child: u32,
    pub next_child: u32,
    pub prev_child: u32,
    /// Whether the node is in the device eviction order (unlocked, device-resident, no
    /// device-resident child).
    pub in_leaves: bool,
    /// Whether the node is in the host eviction order (unlocked, host-only, no children).
    pub in_host_leaves: bool,
    pub on_device: bool,
    pub on_host: bool,
    pub hits: u64,
    pub access: u64,
    pub creation: u64,
    pub priority: i64,
    data: Box<[u32]>,
}

impl Node {
    /// A device-resident node over `data` = key ++ value (equal halves).
    pub fn new(id: u64, parent: u32, ns: u32, data: Vec<u32>) -> Self {
        debug_assert_eq!(data.len() % 2, 0);
        Self {
            id,
            parent,
            next_sibling: NIL,
            ns,
            lock_ref: 0,
            num_children: 0,
            num_device_children: 0,
            first_child: NIL,
            next_child: NIL,
            prev_child: NIL,
            in_leaves: false,
            in_host_leaves: false,
            on_device: true,
            on_host: false,
            hits: 1,
            access: 0,
            creation: 0,
            priority: 0,
            data: data.into_boxed_slice(),
        }
    }

    fn dead() -> Self {
        let mut node = Self::new(DEAD, NIL, 0, Vec::new());
        node.hits = 0;
        node.on_device = false;
        node
    }

    pub fn is_live(&self) -> bool {
        self.id != DEAD
    }

    #[inline]
    fn num_parts(&self) -> usize {
        1 + usize::from(self.on_device) + usize::from(self.on_host)
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.data.len() / self.num_parts()
    }

    #[inline]
    pub fn key(&self) -> &[u32] {
        &self.data[..self.len()]
    }

    /// The device slots (empty when host-only).
    #[inline]
    pub fn value(&self) -> &[u32] {
        if self.on_device {
            let len = self.len();
            &self.data[len..2 * len]
        } else {
            &[]
        }
    }

    /// The host slots (empty when not backed up).
    #[inline]
    pub fn host_value(&self) -> &[u32] {
        if self.on_host {
            &self.data[self.data.len() - self.len()..]
        } else {
            &[]
        }
    }

    /// Rebuild `data` with the given device and host values (None: absent).
    pub fn set_values(&mut self, value: Option<&[u32]>, host: Option<&[u32]>) {
        let len = self.len();
        let mut data = Vec::with_capacity(
            len * (1 + usize::from(value.is_some()) + usize::from(host.is_some())),
        );
        data.extend_from_slice(self.key());
        data.extend_from_slice(value.unwrap_or_default());
        data.extend_from_slice(host.unwrap_or_default());
        self.on_device = value.is_some();
        self.on_host = host.is_some();
        self.data = data.into_boxed_slice();
    }

    /// Keep tokens [n..] here (both values) and return the first n as a new data block in the
    /// same layout; the new node takes this one's `on_device` / `on_host`.
    pub fn split_off_front(&mut self, n: usize) -> Vec<u32> {
        let len = self.len();
        let mut front = Vec::with_capacity(n * self.num_parts());
        let mut rest = Vec::with_capacity((len - n) * self.num_parts());
        for part in self.data.chunks_exact(len) {
            front.extend_from_slice(&part[..n]);
            rest.extend_from_slice(&part[n..]);
        }
        self.data = rest.into_boxed_slice();
        front
    }

    fn heap_bytes(&self) -> usize {
        if self.data.is_empty() {
            0
        } else {
            self.data.len() * 4 + ALLOC_OVERHEAD
        }
    }
}

pub(crate) struct Arena {
    pub nodes: Vec<Node>,
    free_slots: Vec<u32>,
    slot_of: FxHashMap<u64, u32>,
}

impl Arena {
    pub fn new() -> Self {
        let mut arena = Self {
            nodes: Vec::new(),
            free_slots: Vec::new(),
            slot_of: FxHashMap::default(),
        };
        let root = arena.alloc(Node::new(0, NIL, 0, Vec::new()));
        debug_assert_eq!(root, ROOT);
        arena
    }

    pub fn slot(&self, id: u64) -> Option<u32> {
        self.slot_of.get(&id).copied()
    }

    pub fn alloc(&mut self, node: Node) -> u32 {
        let id = node.id;
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.nodes[slot as usize] = node;
                slot
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.slot_of.insert(id, slot);
        slot
    }

    pub fn release(&mut self, slot: u32) {
        let node = std::mem::replace(&mut self.nodes[slot as usize], Node::dead());
        self.slot_of.remove(&node.id);
        self.free_slots.push(slot);
    }

    /// Live nodes, the root included.
    pub fn live_count(&self) -> usize {
        self.slot_of.len()
    }

    /// (id, slot) of every live node, in no particular order.
    pub fn id_slots(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.slot_of.iter().map(|(&id, &slot)| (id, slot))
    }

    pub fn memory_bytes(&self) -> usize {
        let structs = self.nodes.capacity() * std::mem::size_of::<Node>();
        let blocks: usize = self.nodes.iter().map(Node::heap_bytes).sum();
        structs + blocks + self.free_slots.capacity() * 4 + map_bytes(&self.slot_of)
    }
}

/// Approximate heap bytes of a hashbrown map: buckets (a power of two, 7/8 load) of key+value,
/// plus one control byte each.
pub(crate) fn map_bytes<K, V, S>(map: &std::collections::HashMap<K, V, S>) -> usize {
    if map.capacity() == 0 {
        return 0;
    }
    let buckets = (map.capacity() * 8 / 7).next_power_of_two();
    buckets * (std::mem::size_of::<(K, V)>() + 1)
}
