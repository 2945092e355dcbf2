//! Token ids and slot indices at the tree's edge: the compact u32 form and key comparison.

use crate::error::{bad, CoreResult};
use crate::NO_TOKEN;

/// A token id or slot index as the caller holds it (u32, or i64 straight from numpy); the tree
/// stores `compact()`, which is `NO_TOKEN` for a value it cannot hold.
pub trait CompactId: Copy + Send + Sync + std::fmt::Debug {
    fn compact(self) -> u32;

    /// Whether this id equals a stored one (ids that cannot be stored equal none).
    #[inline]
    fn diff(self, stored: u32) -> u64 {
        u64::from(self.compact() ^ stored)
    }
}

impl CompactId for u32 {
    #[inline]
    fn compact(self) -> u32 {
        self
    }
}

impl CompactId for i32 {
    #[inline]
    fn compact(self) -> u32 {
        if self >= 0 {
            self as u32
        } else {
            NO_TOKEN
        }
    }
}

impl CompactId for i64 {
    #[inline]
    fn compact(self) -> u32 {
        if (self as u64) < u64::from(NO_TOKEN) {
            self as u32
        } else {
            NO_TOKEN
        }
    }

    #[inline]
    fn diff(self, stored: u32) -> u64 {
        // Stored ids are below NO_TOKEN, so plain 64-bit equality is exact and vectorizes.
        (self as u64) ^ u64::from(stored)
    }
}

/// Length of the common prefix of a stored key and a query.
#[inline]
pub(crate) fn common_len<T: CompactId>(a: &[u32], b: &[T]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    const BLOCK: usize = 32;
    let mut i = 0;
    // Branch-free blocks vectorize; the tail finds the exact position.
    while i + BLOCK <= n {
        let diff = a[i..i + BLOCK]
            .iter()
            .zip(&b[i..i + BLOCK])
            .fold(0u64, |acc, (&x, y)| acc | y.diff(x));
        if diff != 0 {
            break;
        }
        i += BLOCK;
    }
    while i < n && b[i].diff(a[i]) == 0 {
        i += 1;
    }
    i
}

/// Every value below `NO_TOKEN`, else BadArgument naming the first that is not.
pub fn check_ids<T: CompactId>(values: &[T], name: &str) -> CoreResult<()> {
    if values
        .iter()
        .fold(true, |ok, v| ok & (v.compact() != NO_TOKEN))
    {
        return Ok(());
    }
    match values.iter().find(|v| v.compact() == NO_TOKEN) {
        Some(v) => bad(crate::out_of_u32(name, format!("{v:?}"))),
        None => Ok(()),
    }
}
