//! Unit tests of the host tier (the parity with the Python twin is tested from Python).

use super::tests::Rng;
use super::*;

fn tree(host_slots: i64) -> RadixTree {
    RadixTree::with_host(1, EvictionPolicy::Lru, host_slots).unwrap()
}

fn ins(t: &mut RadixTree, tokens: &[u32], first_slot: u32) -> (usize, i64) {
    let slots: Vec<u32> = (0..tokens.len() as u32).map(|i| first_slot + i).collect();
    let (cached, node) = t.insert(tokens, &slots, None, 0).unwrap();
    t.sanity_check().unwrap();
    (cached, node as i64)
}

/// One node over `tokens` (slots from 10), backed up and evicted from the device.
fn host_only(tokens: &[u32]) -> (RadixTree, i64) {
    let mut t = tree(16);
    let (_, leaf) = ins(&mut t, tokens, 10);
    t.backup(leaf, 1).unwrap();
    assert_eq!(t.evict(tokens.len()).len(), tokens.len());
    t.sanity_check().unwrap();
    (t, leaf)
}

#[test]
fn no_host_tier_changes_nothing() {
    let mut t = tree(0);
    let (_, leaf) = ins(&mut t, &[1, 2, 3], 4);
    assert_eq!(t.backup(leaf, 1).unwrap(), (vec![], vec![]));
    assert_eq!(t.evict_write_back(3), (vec![4, 5, 6], vec![], vec![]));
    assert_eq!(
        (t.node_count(), t.host_capacity(), t.evict_host(5)),
        (0, 0, 0)
    );
    assert!(RadixTree::with_host(4, EvictionPolicy::Lru, 1 << 32).is_err());
    assert!(RadixTree::with_host(4, EvictionPolicy::Lru, -1).is_err());
}

#[test]
fn backup_evict_load_back_round_trip() {
    let (mut t, leaf) = host_only(&[1, 2, 3, 4]);
    assert_eq!(
        (t.node_count(), t.total_size(), t.host_used_size()),
        (1, 0, 4)
    );
    assert_eq!(t.match_prefix(&[1u32, 2, 3, 4], None), (vec![], 0));
    let (dev, dev_node, host, host_node) = t.match_prefix_host(&[1u32, 2, 3, 4, 5], None);
    assert_eq!(
        (dev, dev_node, host, host_node),
        (vec![], 0, vec![1, 2, 3, 4], leaf as u64)
    );
    assert!(t.load_back(leaf, &[20u32, 21, 22]).is_err());
    t.load_back(leaf, &[20u32, 21, 22, 23]).unwrap();
    assert_eq!(
        t.match_prefix(&[1u32, 2, 3, 4], None).0,
        vec![20, 21, 22, 23]
    );
    assert_eq!((t.evictable_size(), t.host_used_size()), (4, 4));
    t.sanity_check().unwrap();
    assert_eq!(t.evict(1), vec![20, 21, 22, 23]);
    assert_eq!(t.node_count(), 1);
    t.sanity_check().unwrap();
}

#[test]
fn evict_deletes_an_unbacked_node_with_its_host_only_descendants() {
    let mut t = tree(16);
    ins(&mut t, &[1, 2], 10);
    ins(&mut t, &[1, 2, 3, 4], 10);
    assert_eq!(
        t.evict_write_back(1),
        (vec![12, 13], vec![12, 13], vec![1, 2])
    );
    t.sanity_check().unwrap();
    assert_eq!(t.evict(1), vec![10, 11]);
    assert_eq!(
        (t.node_count(), t.host_used_size(), t.total_size()),
        (0, 0, 0)
    );
    t.sanity_check().unwrap();
    let (_, leaf) = ins(&mut t, &[5], 9);
    assert_eq!(t.backup(leaf, 1).unwrap(), (vec![9], vec![3]));
}

#[test]
fn host_eviction_follows_the_policy_and_skips_locks() {
    let mut t = tree(6);
    let mut leaves = Vec::new();
    for tok in 1..=3u32 {
        let (_, leaf) = ins(&mut t, &[tok, tok], 10 * tok);
        t.backup(leaf, 1).unwrap();
        leaves.push(leaf);
    }
    t.evict(6);
    t.match_prefix_host(&[1u32, 1], None);
    t.lock(leaves[1]).unwrap();
    assert_eq!(t.evict_host(1), 2);
    assert!(t.match_prefix_host(&[3u32, 3], None).2.is_empty());
    assert_eq!(t.evict_host(100), 2);
    assert_eq!((t.node_count(), t.host_used_size()), (1, 2));
    t.sanity_check().unwrap();
    t.unlock(leaves[1]).unwrap();
    assert_eq!(t.evict_host(1), 2);
    assert_eq!(t.node_count(), 0);
    t.sanity_check().unwrap();
}

#[test]
fn splits_inside_host_only_nodes_split_both_values() {
    let (mut t, leaf) = host_only(&[1, 2, 3, 4, 5, 6]);
    let (dev, _, host, upper) = t.match_prefix_host(&[1u32, 2, 3, 9], None);
    assert_eq!((dev, host), (vec![], vec![1, 2, 3]));
    assert_ne!(upper, leaf as u64);
    t.sanity_check().unwrap();
    t.load_back(upper as i64, &[30u32, 31, 32]).unwrap();
    let (dev, dev_node, host, host_node) = t.match_prefix_host(&[1u32, 2, 3, 4, 5, 6], None);
    assert_eq!((dev, dev_node), (vec![30, 31, 32], upper));
    assert_eq!((host, host_node), (vec![4, 5, 6], leaf as u64));
    t.sanity_check().unwrap();
}

#[test]
fn insert_gives_host_only_nodes_the_callers_slots() {
    let mut t = tree(16);
    ins(&mut t, &[1, 2], 10);
    let (_, leaf) = ins(&mut t, &[1, 2, 3, 4], 10);
    t.backup(leaf, 1).unwrap();
    t.evict(2);
    let (cached, _) = t
        .insert(&[1u32, 2, 3, 4, 5], &[10u32, 11, 22, 23, 24], None, 0)
        .unwrap();
    assert_eq!(cached, 2);
    assert_eq!(
        t.match_prefix(&[1u32, 2, 3, 4, 5], None).0,
        vec![10, 11, 22, 23, 24]
    );
    assert_eq!((t.total_size(), t.host_used_size()), (5, 4));
    t.sanity_check().unwrap();
}

#[test]
fn sanity_check_catches_a_broken_host_ledger() {
    let (mut t, _) = host_only(&[1, 2, 3]);
    t.host.free(&[1]).unwrap();
    assert!(t.sanity_check().is_err());
    let (mut t, leaf) = host_only(&[1, 2, 3]);
    let slot = t.slot(leaf).unwrap();
    t.node_mut(slot).set_values(None, None);
    assert!(t.sanity_check().is_err());
    let (mut t, leaf) = host_only(&[1, 2, 3]);
    let slot = t.slot(leaf).unwrap();
    t.node_mut(slot).set_values(None, Some(&[1, 1, 2]));
    assert!(t.sanity_check().is_err());
    let (mut t, _) = host_only(&[1, 2, 3]);
    t.evictable += 1;
    assert!(t.sanity_check().is_err());
}

#[test]
fn random_tier_operations_keep_every_invariant() {
    for (seed, policy) in [
        (1u64, EvictionPolicy::Lru),
        (2, EvictionPolicy::Lfu),
        (3, EvictionPolicy::Priority),
    ] {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut t = RadixTree::with_host(2, policy, 40).unwrap();
        let (mut next_slot, mut seen, mut locked) = (2u32, vec![0i64], Vec::new());
        for _ in 0..3000 {
            let len = 2 + rng.below(12) as usize;
            let tokens: Vec<u32> = (0..len).map(|_| rng.below(3) as u32).collect();
            match rng.below(9) {
                0 | 1 => {
                    let slots: Vec<u32> = (next_slot..next_slot + len as u32).collect();
                    next_slot += len as u32;
                    let (_, node) = t
                        .insert(&tokens, &slots, None, rng.below(3) as i64)
                        .unwrap();
                    seen.push(node as i64);
                }
                2 => {
                    let node = seen[rng.below(seen.len() as u64) as usize];
                    let _ = t.backup(node, 1 + rng.below(2) as i64);
                }
                3 => {
                    let (_, _, host, node) = t.match_prefix_host(&tokens, None);
                    let slots: Vec<u32> = (next_slot..next_slot + host.len() as u32).collect();
                    next_slot += host.len() as u32;
                    t.load_back(node as i64, &slots).unwrap();
                }
                4 => drop(t.evict(rng.below(10) as usize)),
                5 => drop(t.evict_write_back(rng.below(10) as usize)),
                6 => drop(t.evict_host(rng.below(10) as usize)),
                7 => {
                    let node = seen[rng.below(seen.len() as u64) as usize];
                    if t.lock(node).is_ok() {
                        locked.push(node);
                    }
                }
                _ => {
                    if let Some(node) = locked.pop() {
                        t.unlock(node).unwrap();
                    }
                }
            }
            t.sanity_check().unwrap();
        }
    }
}
