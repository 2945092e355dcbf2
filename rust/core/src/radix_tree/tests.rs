//! Unit tests of the radix tree (the parity with the Python twin is tested from Python).

use super::*;

fn tree(ps: i64, policy: EvictionPolicy) -> RadixTree {
    RadixTree::new(ps, policy).unwrap()
}

fn ins(t: &mut RadixTree, tokens: &[u32], first_slot: u32) -> (usize, u64) {
    let slots: Vec<u32> = (0..tokens.len() as u32).map(|i| first_slot + i).collect();
    let got = t.insert(tokens, &slots, None, 0).unwrap();
    t.sanity_check().unwrap();
    got
}

#[test]
fn ids_count_up_and_splits_take_a_fresh_id() {
    let mut t = tree(1, EvictionPolicy::Lru);
    assert_eq!(ins(&mut t, &[1, 2, 3, 4], 10), (0, 1));
    assert_eq!(ins(&mut t, &[1, 2, 5], 20), (2, 3)); // upper half [1, 2] is node 2
    assert_eq!(t.node_count(), 3);
    let (slots, last) = t.match_prefix(&[1, 2, 3, 4, 9], None);
    assert_eq!((slots, last), (vec![10, 11, 12, 13], 1));
    let (slots, last) = t.match_prefix(&[7], None);
    assert_eq!((slots.len(), last), (0, 0));
    assert_eq!(t.total_size(), 5);
    t.reset();
    assert_eq!(t.node_count(), 0);
    assert!(t.lock(1).is_err());
    assert_eq!(ins(&mut t, &[1], 1), (0, 4));
}

#[test]
fn pages_truncate_keys_and_matches() {
    let mut t = tree(4, EvictionPolicy::Lru);
    assert_eq!(ins(&mut t, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 100), (0, 1));
    assert_eq!(t.total_size(), 8);
    // Diverges inside the second page: the match stops at the page boundary and splits there.
    let (slots, last) = t.match_prefix(&[1, 2, 3, 4, 5, 6, 0, 8], None);
    assert_eq!((slots, last), (vec![100, 101, 102, 103], 2));
    t.sanity_check().unwrap();
    assert_eq!(ins(&mut t, &[1, 2, 3], 50), (0, 0)); // shorter than a page: nothing to insert
}

#[test]
fn namespaces_never_share_nodes() {
    let mut t = tree(1, EvictionPolicy::Lru);
    t.insert(&[1, 2], &[1, 2], Some("a"), 0).unwrap();
    assert_eq!(t.insert(&[1, 2], &[3, 4], Some("b"), 0).unwrap(), (0, 2));
    assert_eq!(t.insert(&[1, 2], &[5, 6], Some(""), 0).unwrap(), (0, 3));
    assert_eq!(t.insert(&[1, 2], &[7, 8], None, 0).unwrap(), (2, 3));
    assert_eq!(t.match_prefix(&[1, 2], Some("b")).0, vec![3, 4]);
    assert_eq!(t.match_prefix(&[1, 2], Some("zzz")).1, 0);
    t.sanity_check().unwrap();
    assert_eq!(t.evict(100).len(), 6);
    t.sanity_check().unwrap();
    assert_eq!(t.namespaces.len(), 0);
}

#[test]
fn locks_protect_paths_and_split_keeps_them() {
    let mut t = tree(1, EvictionPolicy::Lru);
    ins(&mut t, &[1, 2, 3, 4], 1);
    t.lock(1).unwrap();
    assert_eq!((t.evictable_size(), t.protected_size()), (0, 4));
    let (_, upper) = t.match_prefix(&[1, 2, 9], None);
    assert_eq!(upper, 2);
    t.sanity_check().unwrap();
    assert_eq!((t.evictable_size(), t.protected_size()), (0, 4));
    assert!(t.evict(10).is_empty());
    t.unlock(1).unwrap();
    assert!(matches!(t.unlock(1), Err(CoreError::NotLocked(_))));
    assert!(matches!(t.unlock(0), Err(CoreError::NotLocked(_))));
    t.lock(0).unwrap();
    t.unlock(0).unwrap();
    assert!(matches!(t.lock(99), Err(CoreError::BadArgument(_))));
    assert!(matches!(t.lock(-1), Err(CoreError::BadArgument(_))));
    assert_eq!((t.evictable_size(), t.protected_size()), (4, 0));
    t.sanity_check().unwrap();
}

#[test]
fn eviction_follows_each_policy() {
    // Three leaves under one prefix: A (created 1st), B, C; then touch A; insert C twice more.
    let run = |policy| {
        let mut t = tree(1, policy);
        ins(&mut t, &[9, 1], 10); // node 1: [9, 1]
        ins(&mut t, &[9, 2], 20); // node 2 = [9] (split), node 3 = [2]
        t.insert(&[9, 3], &[30, 31], None, 5).unwrap(); // node 4 = [3], priority 5
        t.match_prefix(&[9, 1], None);
        ins(&mut t, &[9, 3], 40);
        ins(&mut t, &[9, 3], 40);
        let order: Vec<i64> = (0..3).flat_map(|_| t.evict(1)).collect();
        t.sanity_check().unwrap();
        order
    };
    // Leaves after the splits: node 1 = [1] (slot 11), node 3 = [2] (slot 21), node 4 = [3] (31).
    assert_eq!(run(EvictionPolicy::Lru), vec![21, 11, 31]);
    assert_eq!(run(EvictionPolicy::Lfu), vec![21, 11, 31]);
    assert_eq!(run(EvictionPolicy::Fifo), vec![11, 21, 31]);
    assert_eq!(run(EvictionPolicy::Priority), vec![21, 11, 31]);
}

#[test]
fn evict_frees_parents_that_become_leaves() {
    let mut t = tree(1, EvictionPolicy::Lru);
    ins(&mut t, &[1, 2], 1);
    ins(&mut t, &[1, 3], 3);
    let freed = t.evict(usize::MAX);
    assert_eq!(freed.len(), 3);
    assert_eq!(t.node_count(), 0);
    t.sanity_check().unwrap();
}

#[test]
fn dfs_weight_order_visits_heavy_subtrees_first() {
    let mut t = tree(1, EvictionPolicy::Lru);
    let (_, a) = ins(&mut t, &[1, 1], 1);
    let (_, b) = ins(&mut t, &[2], 3);
    let (_, c) = ins(&mut t, &[1, 2], 4); // splits a: node 3 = [1] -> {a = [1], c = [2]}
    let ids = [b as i64, a as i64, 0, c as i64, b as i64];
    // Root's children b (id 2) and node 3 both weigh 2: the smaller id goes first.
    assert_eq!(t.dfs_weight_order(&ids).unwrap(), vec![0, 4, 1, 3, 2]);
    assert!(t.dfs_weight_order(&[42]).is_err());
}

#[test]
fn pretty_print_matches_the_python_layout() {
    let mut t = tree(1, EvictionPolicy::Lru);
    ins(&mut t, &[1, 2, 3], 1);
    ins(&mut t, &[1, 5], 4);
    let text = t.pretty_print();
    assert_eq!(text, "[0] len=0 lock=0 \n  [2] len=1 lock=0 1\n    [1] len=2 lock=0 2 3\n    [3] len=1 lock=0 5\n#tokens: 4");
}

#[test]
fn bad_input_changes_nothing() {
    assert!(RadixTree::new(0, EvictionPolicy::Lru).is_err());
    let mut t = tree(1, EvictionPolicy::Lru);
    assert!(t.insert(&[1, 2], &[1], None, 0).is_err());
    assert_eq!((t.node_count(), t.clock), (0, 0));
}

/// xorshift64*, so the stress tests need no crate.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

#[test]
fn random_operations_keep_every_invariant() {
    for (ps, policy) in [
        (1, EvictionPolicy::Lru),
        (4, EvictionPolicy::Lfu),
        (2, EvictionPolicy::Priority),
    ] {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ps as u64);
        let mut t = tree(ps, policy);
        let mut locked: Vec<i64> = Vec::new();
        let mut next_slot = 1u32;
        for _ in 0..3000 {
            let len = rng.below(24) as usize;
            let tokens: Vec<u32> = (0..len).map(|_| rng.below(3) as u32).collect();
            let ns = ["", "x", "y"][rng.below(3) as usize];
            match rng.below(5) {
                0 | 1 => {
                    let slots: Vec<u32> = (0..len as u32).map(|i| next_slot + i).collect();
                    next_slot += len as u32;
                    t.insert(&tokens, &slots, Some(ns), rng.below(3) as i64)
                        .unwrap();
                }
                2 => {
                    let (slots, node) = t.match_prefix(&tokens, Some(ns));
                    assert_eq!(slots.len() % ps as usize, 0);
                    if rng.below(2) == 0 {
                        t.lock(node as i64).unwrap();
                        locked.push(node as i64);
                    }
                }
                3 if !locked.is_empty() => {
                    let i = rng.below(locked.len() as u64) as usize;
                    t.unlock(locked.swap_remove(i)).unwrap();
                }
                _ => {
                    let before = t.total_size();
                    let want = rng.below(8) as usize;
                    let freed = t.evict(want);
                    assert_eq!(t.total_size(), before - freed.len());
                    assert!(freed.len() >= want.min(t.evictable_size() + freed.len()));
                }
            }
            t.sanity_check().unwrap();
            assert!(t.memory_bytes() > 0);
        }
    }
}

#[test]
fn ids_the_tree_cannot_hold_never_match_and_are_refused() {
    let mut t = tree(1, EvictionPolicy::Lru);
    assert!(t.insert(&[1i64, -1], &[1i64, 2], None, 0).is_err());
    assert!(t.insert(&[1i64, 2], &[1i64, 1 << 40], None, 0).is_err());
    assert!(t.insert(&[1u32, u32::MAX], &[1u32, 2], None, 0).is_err());
    assert_eq!((t.node_count(), t.clock), (0, 0));
    t.insert(&[1i64, 2], &[5i64, 6], None, 0).unwrap();
    assert_eq!(t.match_prefix(&[1i64, -2], None).0, vec![5]);
    assert_eq!(t.match_prefix(&[1i64, 2 + (1 << 32)], None).0, vec![5]);
    assert_eq!(t.match_prefix(&[1i32, 2], None).0, vec![5, 6]);
}
