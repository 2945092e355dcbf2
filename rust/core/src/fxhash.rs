//! A small multiplicative hasher for integer keys (node ids, edge keys); SipHash is overkill here.

use std::hash::{BuildHasherDefault, Hasher};

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

#[derive(Default, Clone, Copy)]
pub struct FxHasher {
    hash: u64,
}

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn finish(&self) -> u64 {
        // hashbrown takes its 7 control bits from the top: fold the well-mixed high bits down too.
        self.hash ^ (self.hash >> 29)
    }
}

pub type FxBuildHasher = BuildHasherDefault<FxHasher>;
pub type FxHashMap<K, V> = std::collections::HashMap<K, V, FxBuildHasher>;

/// A 32-bit hash of a namespace id and a page of tokens (the identity for a plain 1-token page).
#[inline]
pub fn page_hash(ns: u32, page: &[u32]) -> u32 {
    if ns == 0 && page.len() == 1 {
        return page[0];
    }
    let mut h = FxHasher {
        hash: u64::from(ns),
    };
    for &t in page {
        h.add(u64::from(t));
    }
    let x = h.finish();
    (x ^ (x >> 32)) as u32
}
