//! Locks and the two eviction candidate sets (device and host) of the radix tree.
//!
//! Locks count references along the path to the root; only device-resident tokens move
//! between the evictable and protected ledgers, on 0 <-> 1 transitions. After every change a
//! node's candidacy is recomputed (`refresh`): device candidates are unlocked device-resident
//! nodes without a device-resident child, host candidates unlocked host-only nodes without
//! children.

use super::node::ROOT;
use super::RadixTree;
use crate::error::{CoreError, CoreResult};

impl RadixTree {
    pub fn lock(&mut self, node_id: i64) -> CoreResult<()> {
        let slot = self.slot(node_id)?;
        if slot == ROOT {
            self.root_locks += 1;
            return Ok(());
        }
        self.add_lock(slot, true)
    }

    pub fn unlock(&mut self, node_id: i64) -> CoreResult<()> {
        let slot = self.slot(node_id)?;
        if slot == ROOT {
            if self.root_locks == 0 {
                return Err(CoreError::NotLocked(
                    "unlock of the root, which is not locked".into(),
                ));
            }
            self.root_locks -= 1;
            return Ok(());
        }
        if self.node(slot).lock_ref == 0 {
            return Err(CoreError::NotLocked(format!(
                "unlock of node {node_id}, which is not locked"
            )));
        }
        self.add_lock(slot, false)
    }

    /// Add (or remove) one lock on the path from `slot` to the root, then fix its leaf status.
    pub(super) fn add_lock(&mut self, slot: u32, lock: bool) -> CoreResult<()> {
        let mut at = slot;
        while at != ROOT {
            let node = self.node_mut(at);
            let (before, on_device) = (node.lock_ref, node.on_device);
            let len = if on_device { node.len() } else { 0 };
            let after = if lock {
                before + 1
            } else {
                before.checked_sub(1).ok_or_else(|| {
                    CoreError::Invariant(format!(
                        "node {} is locked less than its descendants",
                        node.id
                    ))
                })?
            };
            node.lock_ref = after;
            let walked = at;
            at = node.parent;
            match (before, after) {
                (0, 1) => {
                    self.evictable -= len;
                    self.protected += len;
                }
                (1, 0) => {
                    self.protected -= len;
                    self.evictable += len;
                }
                _ => continue,
            }
            // An ancestor is a candidate too when none of its children is on the device.
            if walked != slot {
                self.refresh(walked);
            }
        }
        self.refresh(slot);
        Ok(())
    }

    /// Recompute whether `slot` is a device or a host eviction candidate; update the orders.
    pub(super) fn refresh(&mut self, slot: u32) {
        if slot == ROOT {
            return;
        }
        let node = &self.arena.nodes[slot as usize];
        let unlocked = node.lock_ref == 0;
        let device = unlocked && node.on_device && node.num_device_children == 0;
        let host = unlocked && !node.on_device && node.num_children == 0;
        if device != node.in_leaves {
            if device {
                self.leaves.insert(node);
            } else {
                self.leaves.remove(node);
            }
        }
        if host != node.in_host_leaves {
            if host {
                self.host_leaves.insert(node);
            } else {
                self.host_leaves.remove(node);
            }
        }
        let node = self.node_mut(slot);
        node.in_leaves = device;
        node.in_host_leaves = host;
    }
}
