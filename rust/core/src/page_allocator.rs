//! PageAllocator: which KV pages are free (twin of `page_allocator.py`).
//!
//! - `num_slots // page_size` pages, numbered 1..=num_pages; page 0 is reserved as a padding
//!   target. Slot s lives in page s / page_size.
//! - Free pages form a FIFO queue: allocation takes from the head; `free` appends the distinct
//!   pages of the given slots, in ascending page order, to the tail.
//! - Allocation returns `None` and changes nothing when there are not enough free pages.
//!   `alloc_extend` and `alloc_decode` also return `None`, after validating their arguments and
//!   before taking any page, when a request's seq_len exceeds `capacity()`: every position has its
//!   own slot, so such a request can never be held, however small its need of new pages.
//! - A slot in page 0, outside the pool, or in a page already free (or staged) is rejected and
//!   nothing changes. Between `free_group_begin` and `free_group_end` frees are validated and
//!   staged; they become free, in staging order, at the end.
//! - Page-continuing allocation for request i (prefix p, sequence s, `last_locs[i]` the slot of
//!   token p-1): first min(s, ceil_page(p)) - p slots after last_loc, then new pages in request
//!   order; it needs ceil(s/P) - ceil(p/P) new pages.

use std::collections::VecDeque;

use crate::error::{bad, CoreError, CoreResult};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Page {
    Reserved,
    Used,
    Free,
    Staged,
}

#[derive(Debug, Clone)]
pub struct PageAllocator {
    page_size: usize,
    num_pages: usize,
    free: VecDeque<u32>,
    pages: Vec<Page>,
    staged: Option<Vec<u32>>,
}

impl PageAllocator {
    pub fn new(num_slots: i64, page_size: i64) -> CoreResult<Self> {
        let page_size = crate::check_page_size(page_size)?;
        if num_slots < 0 {
            return bad(format!("num_slots must be >= 0, got {num_slots}"));
        }
        let num_pages = usize::try_from(num_slots).unwrap_or(usize::MAX) / page_size;
        if num_pages >= u32::MAX as usize {
            return bad(format!(
                "num_slots {num_slots} makes more pages than the native core supports"
            ));
        }
        let no_memory = |_| {
            CoreError::BadArgument(format!("cannot allocate bookkeeping for {num_pages} pages"))
        };
        let mut free = VecDeque::new();
        free.try_reserve_exact(num_pages).map_err(no_memory)?;
        free.extend(1..=num_pages as u32);
        let mut pages = Vec::new();
        pages.try_reserve_exact(num_pages + 1).map_err(no_memory)?;
        pages.push(Page::Reserved);
        pages.resize(num_pages + 1, Page::Free);
        Ok(Self {
            page_size,
            num_pages,
            free,
            pages,
            staged: None,
        })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Usable slots (whole pages only).
    pub fn capacity(&self) -> usize {
        self.num_pages * self.page_size
    }

    pub fn available_size(&self) -> usize {
        self.free.len() * self.page_size
    }

    /// `num_tokens` slots in whole pages, or None when there are not enough.
    pub fn alloc(&mut self, num_tokens: usize) -> CoreResult<Option<Vec<i64>>> {
        let ps = self.page_size;
        if !num_tokens.is_multiple_of(ps) {
            return bad(format!(
                "alloc({num_tokens}) is not a multiple of page_size {ps}; use alloc_extend for partial pages"
            ));
        }
        let num_pages = num_tokens / ps;
        if num_pages > self.free.len() {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(num_tokens);
        let pages = self.take(num_pages);
        if ps == 1 {
            out.extend(pages.iter().map(|&p| i64::from(p)));
        } else {
            for page in pages {
                let base = i64::from(page) * ps as i64;
                out.extend(base..base + ps as i64);
            }
        }
        Ok(Some(out))
    }

    pub fn free(&mut self, slots: &[i64]) -> CoreResult<()> {
        if slots.is_empty() {
            return Ok(());
        }
        let ps = self.page_size as i64;
        let end = (self.num_pages as i64 + 1) * ps;
        if let Some(&s) = slots.iter().find(|&&s| s < ps || s >= end) {
            return bad(format!(
                "slot {s} is not in the pool (valid slots: {ps}..{})",
                end - 1
            ));
        }
        // Slots are in 0..2^32 pages * page_size here; a shift beats a division per slot.
        let mut pages: Vec<u32> = if self.page_size.is_power_of_two() {
            let shift = self.page_size.trailing_zeros();
            slots.iter().map(|&s| (s as u64 >> shift) as u32).collect()
        } else {
            slots
                .iter()
                .map(|&s| (s as u64 / ps as u64) as u32)
                .collect()
        };
        if !pages.is_sorted() {
            pages.sort_unstable();
        }
        pages.dedup();
        if let Some(&p) = pages
            .iter()
            .find(|&&p| matches!(self.pages[p as usize], Page::Free | Page::Staged))
        {
            return bad(format!("double free of page {p} (slot page_size={ps})"));
        }
        match self.staged.as_mut() {
            Some(staged) => {
                for &p in &pages {
                    self.pages[p as usize] = Page::Staged;
                }
                staged.extend_from_slice(&pages);
            }
            None => self.release(&pages),
        }
        Ok(())
    }

    /// Whether `slot` lies in an allocated page (not free, staged or reserved).
    pub fn is_allocated(&self, slot: u64) -> bool {
        let page = slot / self.page_size as u64;
        usize::try_from(page)
            .ok()
            .and_then(|p| self.pages.get(p))
            .is_some_and(|&p| p == Page::Used)
    }

    /// Bytes of bookkeeping (the free queue and the page states).
    pub fn memory_bytes(&self) -> usize {
        self.free.capacity() * 4 + self.pages.capacity() * std::mem::size_of::<Page>()
    }

    pub fn free_group_begin(&mut self) -> CoreResult<()> {
        if self.staged.is_some() {
            return Err(CoreError::FreeGroup(
                "free_group_begin() called twice without free_group_end()".into(),
            ));
        }
        self.staged = Some(Vec::new());
        Ok(())
    }

    pub fn free_group_end(&mut self) -> CoreResult<()> {
        let Some(staged) = self.staged.take() else {
            return Err(CoreError::FreeGroup(
                "free_group_end() called without free_group_begin()".into(),
            ));
        };
        self.release(&staged);
        Ok(())
    }

    /// Page-continuing allocation (see the module docs); None when there are not enough pages.
    pub fn alloc_extend(
        &mut self,
        prefix_lens: &[i64],
        seq_lens: &[i64],
        last_locs: &[i64],
    ) -> CoreResult<Option<Vec<i64>>> {
        let (n, m, k) = (prefix_lens.len(), seq_lens.len(), last_locs.len());
        if n != m || m != k {
            return bad(format!(
                "prefix_lens, seq_lens and last_locs differ in length ({n}, {m}, {k})"
            ));
        }
        for i in 0..n {
            self.check_request(i, prefix_lens[i], seq_lens[i], last_locs[i])?;
        }
        // seq_lens are >= 0 here (checked), so the cast is exact.
        if seq_lens.iter().any(|&s| s as u64 > self.capacity() as u64) {
            return Ok(None); // more than the pool could ever hold
        }
        let ps = self.page_size as i64;
        let need = |i: usize| (ceil_div(seq_lens[i], ps) - ceil_div(prefix_lens[i], ps)) as u64;
        let total: u64 = (0..n).fold(0u64, |acc, i| acc.saturating_add(need(i)));
        if total > self.free.len() as u64 {
            return Ok(None);
        }
        let total_len: i64 = (0..n).map(|i| seq_lens[i] - prefix_lens[i]).sum();
        let mut out = Vec::with_capacity(total_len as usize);
        let taken = self.take(total as usize);
        let mut pages = taken.iter().copied();
        for i in 0..n {
            let (p, s, last) = (prefix_lens[i], seq_lens[i], last_locs[i]);
            let n1 = s.min(ceil_div(p, ps) * ps) - p;
            if n1 > 0 {
                // last_loc was checked to lie in the pool whenever a page is continued.
                out.extend(last + 1..last + 1 + n1);
            }
            let mut rest = s - p - n1;
            let fresh = pages.by_ref().take(need(i) as usize);
            if ps == 1 {
                out.extend(fresh.map(i64::from));
                continue;
            }
            for page in fresh {
                let base = i64::from(page) * ps;
                let take = rest.min(ps);
                out.extend(base..base + take);
                rest -= take;
            }
        }
        Ok(Some(out))
    }

    /// `alloc_extend(seq_lens - 1, seq_lens, last_locs)`: seq_lens count the new token.
    pub fn alloc_decode(
        &mut self,
        seq_lens: &[i64],
        last_locs: &[i64],
    ) -> CoreResult<Option<Vec<i64>>> {
        if seq_lens.iter().any(|&s| s < 1) {
            return bad("seq_lens of alloc_decode count the new token and must be >= 1".into());
        }
        let prefix: Vec<i64> = seq_lens.iter().map(|&s| s - 1).collect();
        self.alloc_extend(&prefix, seq_lens, last_locs)
    }

    fn check_request(&self, i: usize, p: i64, s: i64, last: i64) -> CoreResult<()> {
        let ps = self.page_size as i64;
        if p < 0 || s < p {
            return bad(format!(
                "request {i}: need 0 <= prefix_len <= seq_len, got {p} and {s}"
            ));
        }
        if p % ps == 0 || s == p {
            return Ok(());
        }
        let end = (self.num_pages as i64 + 1) * ps;
        if !(ps <= last && last < end) || (last + 1) % ps != p % ps {
            return bad(format!(
                "request {i}: last_locs={last} does not end a partial page of prefix_len={p} (page_size {ps})"
            ));
        }
        if self.pages[(last / ps) as usize] == Page::Free {
            return bad(format!("request {i}: last_locs={last} lies in a free page"));
        }
        Ok(())
    }

    /// Take `num_pages` from the head of the free queue (the caller checked there are enough).
    fn take(&mut self, num_pages: usize) -> Vec<u32> {
        // Copy out of the ring's two halves as slices: element-wise deque access is slow.
        let (front, back) = self.free.as_slices();
        let from_front = num_pages.min(front.len());
        let mut taken = Vec::with_capacity(num_pages);
        taken.extend_from_slice(&front[..from_front]);
        taken.extend_from_slice(&back[..num_pages - from_front]);
        self.free.drain(..num_pages);
        for &p in &taken {
            self.pages[p as usize] = Page::Used;
        }
        taken
    }

    fn release(&mut self, pages: &[u32]) {
        for &p in pages {
            self.pages[p as usize] = Page::Free;
        }
        self.free.extend(pages);
    }
}

fn ceil_div(a: i64, b: i64) -> i64 {
    -((-a).div_euclid(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_order_and_reserved_page() {
        let mut a = PageAllocator::new(8, 2).unwrap();
        assert_eq!((a.capacity(), a.available_size()), (8, 8));
        assert_eq!(a.alloc(4).unwrap(), Some(vec![2, 3, 4, 5]));
        a.free(&[5, 2]).unwrap();
        // pages 3 and 4 remain; 1 and 2 went to the tail in ascending order.
        assert_eq!(a.alloc(8).unwrap(), Some(vec![6, 7, 8, 9, 2, 3, 4, 5]));
        assert_eq!(a.alloc(2).unwrap(), None);
        assert!(a.alloc(3).is_err());
    }

    #[test]
    fn bad_frees_change_nothing() {
        let mut a = PageAllocator::new(4, 1).unwrap();
        let got = a.alloc(2).unwrap().unwrap();
        assert_eq!(got, vec![1, 2]);
        assert!(a.free(&[0]).is_err());
        assert!(a.free(&[5]).is_err());
        assert!(a.free(&[1, 3]).is_err()); // 3 is free
        assert_eq!(a.available_size(), 2);
        a.free(&[1, 1]).unwrap(); // a duplicate within one call is one page
        assert!(a.free(&[1]).is_err());
    }

    #[test]
    fn free_groups_stage_then_release() {
        let mut a = PageAllocator::new(4, 1).unwrap();
        a.alloc(4).unwrap().unwrap();
        a.free_group_begin().unwrap();
        assert!(a.free_group_begin().is_err());
        a.free(&[3]).unwrap();
        a.free(&[1]).unwrap();
        assert!(a.free(&[3]).is_err());
        assert_eq!(a.available_size(), 0);
        a.free_group_end().unwrap();
        assert!(a.free_group_end().is_err());
        assert_eq!(a.alloc(2).unwrap(), Some(vec![3, 1]));
    }

    #[test]
    fn alloc_extend_continues_the_partial_page() {
        let mut a = PageAllocator::new(16, 4).unwrap();
        let first = a.alloc_extend(&[0], &[6], &[-1]).unwrap().unwrap();
        assert_eq!(first, vec![4, 5, 6, 7, 8, 9]);
        // prefix 6 ends at slot 9 (page 2, offset 1): continue 10, 11, then a new page.
        let more = a.alloc_extend(&[6], &[10], &[9]).unwrap().unwrap();
        assert_eq!(more, vec![10, 11, 12, 13]);
        assert!(a.alloc_extend(&[6], &[7], &[8]).is_err()); // wrong offset
        assert!(a.alloc_extend(&[2], &[1], &[5]).is_err());
        assert_eq!(a.alloc_extend(&[0], &[100], &[-1]).unwrap(), None);
        // Longer than the pool: None even when the prefix leaves a single page to take.
        assert_eq!(a.alloc_extend(&[16], &[17], &[-1]).unwrap(), None);
        assert_eq!(a.alloc_extend(&[15], &[17], &[6]).unwrap(), None);
        assert!(a.alloc_extend(&[18], &[17], &[-1]).is_err()); // bad arguments first
        let dec = a.alloc_decode(&[11], &[13]).unwrap().unwrap();
        assert_eq!(dec, vec![14]);
        assert!(a.alloc_decode(&[0], &[-1]).is_err());
        // last_locs is ignored (however wild) when no page is continued.
        assert_eq!(
            a.alloc_extend(&[4], &[8], &[i64::MAX]).unwrap(),
            Some(vec![16, 17, 18, 19])
        );
    }
}
