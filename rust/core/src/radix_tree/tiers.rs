//! The host tier of the radix tree (HiCache): residency, copies to report, both evictions.
//! Twin of `python/sglite/core/radix_tiers.py`.
//!
//! The tree only does bookkeeping: `backup` and `evict_write_back` return (device source,
//! host destination) slots for the caller to copy; `load_back` takes device slots the caller
//! has filled. Invariants kept here: a device-resident node's parent is device-resident (or the
//! root); the host allocator's used slots are exactly the nodes' host values; the device ledgers
//! count device-resident tokens only.

use super::children::ChildIndex;
use super::node::ROOT;
use super::{check_ids, CompactId, RadixTree};
use crate::error::{bad, CoreResult};

fn wide(values: &[u32]) -> impl Iterator<Item = i64> + '_ {
    values.iter().map(|&v| i64::from(v))
}

/// (freed device slots, device sources, host destinations).
pub type EvictOutcome = (Vec<i64>, Vec<i64>, Vec<i64>);

impl RadixTree {
    pub fn host_capacity(&self) -> usize {
        self.host.capacity()
    }

    pub fn host_available_size(&self) -> usize {
        self.host.available_size()
    }

    pub fn host_used_size(&self) -> usize {
        self.host.capacity() - self.host.available_size()
    }

    /// (device slots, device node id, host slots, host node id): the device match, then its
    /// continuation through host-only nodes (host node == device node when there is none).
    pub fn match_prefix_host<T: CompactId>(
        &mut self,
        tokens: &[T],
        extra_key: Option<&str>,
    ) -> (Vec<i64>, u64, Vec<i64>, u64) {
        let key = self.page_aligned(tokens);
        let ns = self.namespaces.lookup(extra_key);
        self.clock += 1;
        let mut path = std::mem::take(&mut self.path);
        let (last, _) = self.walk(key, ns, None, false, &mut path);
        let (mut device, mut host, mut device_node) = (Vec::new(), Vec::new(), ROOT);
        for &slot in &path {
            let node = self.node(slot);
            if node.on_device {
                device.extend(wide(node.value()));
                device_node = slot;
            } else {
                host.extend(wide(node.host_value()));
            }
        }
        path.clear();
        self.path = path;
        (device, self.node(device_node).id, host, self.node(last).id)
    }

    /// Give a host value to each device-resident node on root..node without one and with
    /// `hits >= min_hits`, root first, until the host runs short: (device sources, host
    /// destinations) for the caller to copy.
    pub fn backup(&mut self, node_id: i64, min_hits: i64) -> CoreResult<(Vec<i64>, Vec<i64>)> {
        let mut at = self.slot(node_id)?;
        let mut path = Vec::new();
        while at != ROOT {
            path.push(at);
            at = self.node(at).parent;
        }
        let (mut src, mut dst) = (Vec::new(), Vec::new());
        for &slot in path.iter().rev() {
            let node = self.node(slot);
            // Device-resident nodes come first on a path; host eviction below only takes
            // host-only nodes (which then read as dead, not on the device).
            if !node.is_live() || !node.on_device {
                break;
            }
            if node.on_host || i128::from(node.hits) < i128::from(min_hits) {
                continue;
            }
            let Some(host) = self.alloc_host(node.len()) else {
                break;
            };
            let node = self.node_mut(slot);
            let value = node.value().to_vec();
            node.set_values(Some(&value), Some(&host));
            src.extend(wide(&value));
            dst.extend(wide(&host));
        }
        Ok((src, dst))
    }

    /// Give `device_slots` (root first) to the host-only chain ending at `host_node_id`; the
    /// caller has copied host -> device. The nodes keep their host values.
    pub fn load_back<S: CompactId>(
        &mut self,
        host_node_id: i64,
        device_slots: &[S],
    ) -> CoreResult<()> {
        let mut at = self.slot(host_node_id)?;
        check_ids(device_slots, "device_slots")?;
        let mut chain = Vec::new();
        while at != ROOT && !self.node(at).on_device {
            chain.push(at);
            at = self.node(at).parent;
        }
        let chain_len: usize = chain.iter().map(|&s| self.node(s).len()).sum();
        if chain_len != device_slots.len() {
            return bad(format!(
                "load_back of node {host_node_id} needs {chain_len} device slots (its host-only chain), got {}",
                device_slots.len()
            ));
        }
        let mut pos = 0;
        for &slot in chain.iter().rev() {
            let len = self.node(slot).len();
            let value: Vec<u32> = device_slots[pos..pos + len]
                .iter()
                .map(|s| s.compact())
                .collect();
            self.set_device_value(slot, &value);
            pos += len;
        }
        Ok(())
    }

    /// Like `evict`, but a candidate without a host value gets one first when the host can
    /// supply it: (freed device slots, device sources, host destinations).
    pub fn evict_write_back(&mut self, num_tokens: usize) -> EvictOutcome {
        self.evict_device(num_tokens, true)
    }

    /// Delete unlocked host-only leaves in policy order until `num_tokens` host tokens are freed
    /// or none is left; returns the host tokens freed.
    pub fn evict_host(&mut self, num_tokens: usize) -> usize {
        let mut freed = 0;
        while freed < num_tokens {
            let Some(id) = self.host_leaves.pop_first() else {
                break;
            };
            let Some(slot) = self.arena.slot(id) else {
                continue;
            };
            let node = self.node(slot);
            let (parent, ns, len) = (node.parent, node.ns, node.len());
            let host: Vec<i64> = wide(node.host_value()).collect();
            self.children.remove(&mut self.arena.nodes, slot);
            if parent == ROOT {
                self.namespaces.release(ns);
            }
            self.arena.release(slot);
            self.free_host(&host);
            freed += len;
            self.refresh(parent);
        }
        freed
    }

    // ------------------------------------------------------------------ internals
    pub(super) fn evict_device(&mut self, num_tokens: usize, write_back: bool) -> EvictOutcome {
        let (mut freed, mut src, mut dst) = (Vec::new(), Vec::new(), Vec::new());
        while freed.len() < num_tokens {
            let Some(id) = self.leaves.pop_first() else {
                break;
            };
            let Some(slot) = self.arena.slot(id) else {
                continue;
            };
            self.node_mut(slot).in_leaves = false;
            if write_back && !self.node(slot).on_host {
                if let Some(host) = self.alloc_host(self.node(slot).len()) {
                    let node = self.node_mut(slot);
                    let value = node.value().to_vec();
                    node.set_values(Some(&value), Some(&host));
                    src.extend(wide(&value));
                    dst.extend(wide(&host));
                }
            }
            freed.extend(wide(self.node(slot).value()));
            if self.node(slot).on_host {
                self.drop_device_value(slot);
            } else {
                self.delete_device_node(slot);
            }
        }
        (freed, src, dst)
    }

    /// `insert` walked `path`: its host-only nodes take the caller's slots. Returns the length
    /// that was already on the device (the path's device part comes first).
    pub(super) fn take_slots_on_host_only<S: CompactId>(
        &mut self,
        path: &[u32],
        slots: &[S],
        walked: usize,
    ) -> usize {
        let (mut pos, mut cached_len) = (0, None);
        for &slot in path {
            let len = self.node(slot).len();
            if !self.node(slot).on_device {
                cached_len.get_or_insert(pos);
                let value: Vec<u32> = slots[pos..pos + len].iter().map(|s| s.compact()).collect();
                self.set_device_value(slot, &value);
            }
            pos += len;
        }
        cached_len.unwrap_or(walked)
    }

    /// A host-only node (whose parent is device-resident) gets device slots.
    fn set_device_value(&mut self, slot: u32, value: &[u32]) {
        let node = self.node_mut(slot);
        let host = node.host_value().to_vec();
        node.set_values(Some(value), Some(&host));
        let (parent, locked) = (node.parent, node.lock_ref > 0);
        if locked {
            self.protected += value.len();
        } else {
            self.evictable += value.len();
        }
        self.node_mut(parent).num_device_children += 1;
        self.refresh(slot);
        self.refresh(parent);
    }

    /// An unlocked device candidate with a host value becomes host-only.
    fn drop_device_value(&mut self, slot: u32) {
        let node = self.node_mut(slot);
        let host = node.host_value().to_vec();
        node.set_values(None, Some(&host));
        let parent = node.parent;
        self.evictable -= host.len();
        self.node_mut(parent).num_device_children -= 1;
        self.refresh(slot);
        self.refresh(parent);
    }

    /// Delete an unlocked device candidate without a host value, with its host-only (and so
    /// unlocked) descendants; their host slots go back in one free.
    fn delete_device_node(&mut self, slot: u32) {
        let mut below = Vec::new();
        let mut stack = ChildIndex::children_of(&self.arena.nodes, slot);
        while let Some(c) = stack.pop() {
            below.push(c);
            stack.extend(ChildIndex::children_of(&self.arena.nodes, c));
        }
        let mut host = Vec::new();
        for &c in below.iter().rev() {
            // Reversed pre-order: every node goes before its parent.
            let node = &self.arena.nodes[c as usize];
            host.extend(wide(node.host_value()));
            if node.in_host_leaves {
                self.host_leaves.remove(node);
            }
            self.children.remove(&mut self.arena.nodes, c);
            self.arena.release(c);
        }
        self.free_host(&host);
        let node = &self.arena.nodes[slot as usize];
        let (parent, ns, len) = (node.parent, node.ns, node.len());
        if node.in_leaves {
            self.leaves.remove(node);
        }
        self.children.remove(&mut self.arena.nodes, slot);
        if parent == ROOT {
            self.namespaces.release(ns);
        }
        self.evictable -= len;
        self.arena.release(slot);
        self.refresh(parent);
    }

    /// Host slots for a node (whole pages), evicting host leaves when short; None when the host
    /// cannot supply them (whatever host eviction did stays done).
    fn alloc_host(&mut self, num_tokens: usize) -> Option<Vec<u32>> {
        let available = self.host.available_size();
        if num_tokens > available {
            self.evict_host(num_tokens - available);
        }
        // Host slots fit in u32: `with_host` bounds host_slots + page_size.
        let slots = self.host.alloc(num_tokens).ok().flatten()?;
        Some(slots.into_iter().map(|s| s as u32).collect())
    }

    fn free_host(&mut self, slots: &[i64]) {
        // Only fails on a broken ownership invariant, which sanity_check reports.
        let freed = self.host.free(slots);
        debug_assert!(freed.is_ok(), "{freed:?}");
    }
}
