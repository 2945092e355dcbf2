//! sglite's tree core in pure Rust: the radix tree (prefix-cache index), the page allocator and
//! the prefill admission budget. No Python here; `rust/python` wraps it as `sglite._core`.
//!
//! The Python twin in `python/sglite/core/` is the specification: both behave the same, down to
//! node ids, eviction order, free-list order and error kinds.

pub mod budget;
pub mod error;
mod fxhash;
pub mod page_allocator;
pub mod radix_tree;

pub use budget::{AddReqResult, PrefillBudget, CLIP_MAX_NEW_TOKENS};
pub use error::{CoreError, CoreResult};
pub use page_allocator::PageAllocator;
pub use radix_tree::{CompactId, EvictionPolicy, RadixTree};

/// Largest page size the tree and the allocator accept.
pub const MAX_PAGE_SIZE: usize = 1 << 16;

/// Validate a page size: 1..=MAX_PAGE_SIZE.
pub fn check_page_size(page_size: i64) -> CoreResult<usize> {
    if page_size < 1 {
        return error::bad(format!("page_size must be >= 1, got {page_size}"));
    }
    match usize::try_from(page_size) {
        Ok(ps) if ps <= MAX_PAGE_SIZE => Ok(ps),
        _ => error::bad(format!(
            "page_size {page_size} is larger than the native core supports ({MAX_PAGE_SIZE})"
        )),
    }
}

/// Token ids and slots are stored as u32 below this value; an id the tree cannot hold compacts
/// to `NO_TOKEN` (u32::MAX), which is never stored, so it simply does not match.
pub const NO_TOKEN: u32 = u32::MAX;

/// The message for a token id or slot that does not fit the tree's u32 storage.
pub fn out_of_u32(name: &str, value: impl std::fmt::Display) -> String {
    format!(
        "{name} has value {value}, outside the supported range 0..={}",
        NO_TOKEN - 1
    )
}
