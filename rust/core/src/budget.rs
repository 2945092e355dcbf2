//! PrefillBudget: the admission arithmetic of one prefill batch (twin of `budget.py`).
//!
//! One budget is built per scheduling pass; it only does arithmetic. Every call gets the current
//! `available` tokens (allocator free + tree evictable). The contract, in short:
//! - `reserve_running`: each running request reserves min(remaining, 4096) tokens, times
//!   `new_token_ratio` (floored) unless it ignores EOS.
//! - `add_req`: charge ceil_page(extend) + page_size + min(max_new, 4096); NO_TOKEN when it does not
//!   fit strictly under the remaining memory, i.e. when min(max_new, 4096) exceeds
//!   `max_new_limit(available - total_offset, extend, page_size)`, the one admission rule;
//!   chunking cuts a request so that prefix + extend ends on a page boundary, and a cut request
//!   reserves no decode tokens.
//! - `max_new_tokens_limit`: the same rule for a prompt alone in an idle pool, for front ends.
//! - `shortfall`: the tokens `available` lacks for `add_req` to admit a request now (0: it fits).
//! - `add_chunk`: the next slice of the request being chunked; it always progresses.
//!
//! Sizes are i64 at the edge and i128 inside, so no sum can overflow.

use crate::error::{bad, CoreResult};

pub const CLIP_MAX_NEW_TOKENS: i64 = 4096;

/// The verdict for the next candidate (same integer values as the Python twin).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum AddReqResult {
    Continue = 0,
    NoToken = 1,
    Other = 2,
}

#[derive(Debug, Clone)]
pub struct PrefillBudget {
    ps: i128,
    rem_input: i128,
    rem_chunk: Option<i128>,
    total_offset: i128,
    current_offset: i128,
    num_admitted: u64,
}

fn check_page_size(page_size: i64) -> CoreResult<i128> {
    if page_size < 1 {
        return bad(format!("page_size must be >= 1, got {page_size}"));
    }
    Ok(i128::from(page_size))
}

/// The admission rule: a request fits iff extend_len + max_new + page_size < room, i.e. iff its
/// (clipped) max_new is at most this. The page of slack stands in for rounding the extend up to
/// whole pages.
fn max_new_limit(room: i128, extend_len: i128, page_size: i128) -> i128 {
    room - extend_len - page_size - 1
}

fn size(value: i64, name: &str) -> CoreResult<i128> {
    if value < 0 {
        return bad(format!("{name} must be >= 0, got {value}"));
    }
    Ok(i128::from(value))
}

impl PrefillBudget {
    /// `rem_chunk_tokens = None` turns chunking off; mixed decode rows are charged up front.
    pub fn new(
        page_size: i64,
        rem_input_tokens: i64,
        rem_chunk_tokens: Option<i64>,
        num_mixed_decode_tokens: i64,
    ) -> CoreResult<Self> {
        let ps = check_page_size(page_size)?;
        let mixed = size(num_mixed_decode_tokens, "num_mixed_decode_tokens")?;
        let rem_input = size(rem_input_tokens, "rem_input_tokens")? - mixed;
        let rem_chunk = match rem_chunk_tokens {
            None => None,
            Some(c) => Some(size(c, "rem_chunk_tokens")? - mixed),
        };
        Ok(Self {
            ps,
            rem_input,
            rem_chunk,
            total_offset: mixed,
            current_offset: mixed,
            num_admitted: 0,
        })
    }

    /// The largest `max_new_tokens` with which `add_req` admits a prompt of `prompt_len` tokens
    /// into an idle pool of `capacity` tokens: capacity - page_size - prompt_len - 1. Callers
    /// treat a limit below 1 as "cannot fit"; from 4096 up `add_req` admits any max_new.
    pub fn max_new_tokens_limit(
        capacity: i64,
        page_size: i64,
        prompt_len: i64,
    ) -> CoreResult<i128> {
        let capacity = size(capacity, "capacity")?;
        let ps = check_page_size(page_size)?;
        let prompt_len = size(prompt_len, "prompt_len")?;
        Ok(max_new_limit(capacity, prompt_len, ps))
    }

    pub fn total_offset(&self) -> i128 {
        self.total_offset
    }

    pub fn current_offset(&self) -> i128 {
        self.current_offset
    }

    pub fn rem_input_tokens(&self) -> i128 {
        self.rem_input
    }

    pub fn rem_chunk_tokens(&self) -> Option<i128> {
        self.rem_chunk
    }

    pub fn num_admitted(&self) -> u64 {
        self.num_admitted
    }

    /// Charge the running batch; returns the tokens reserved.
    pub fn reserve_running(
        &mut self,
        remaining_new_tokens: &[i64],
        ignore_eos: &[bool],
        new_token_ratio: f64,
    ) -> CoreResult<i128> {
        if remaining_new_tokens.len() != ignore_eos.len() {
            return bad(format!(
                "remaining_new_tokens and ignore_eos differ in length ({} vs {})",
                remaining_new_tokens.len(),
                ignore_eos.len()
            ));
        }
        if !(0.0..=1.0).contains(&new_token_ratio) {
            return bad(format!(
                "new_token_ratio must be in [0, 1], got {new_token_ratio}"
            ));
        }
        let mut reserved: i128 = 0;
        for (&r, &exact) in remaining_new_tokens.iter().zip(ignore_eos) {
            let tokens = r.clamp(0, CLIP_MAX_NEW_TOKENS);
            // tokens * ratio is >= 0 and finite, so `as` truncation is Python's int().
            reserved += if exact {
                i128::from(tokens)
            } else {
                (tokens as f64 * new_token_ratio) as i128
            };
        }
        self.total_offset += reserved;
        Ok(reserved)
    }

    /// The verdict for the next candidate, given `available` tokens.
    pub fn state(&self, available: i64) -> CoreResult<AddReqResult> {
        Ok(self.state_of(size(available, "available")?))
    }

    /// Charge a new request: (admitted, state for the next one, granted extend length).
    pub fn add_req(
        &mut self,
        available: i64,
        prefix_len: i64,
        extend_len: i64,
        max_new_tokens: i64,
    ) -> CoreResult<(bool, AddReqResult, i128)> {
        let available = size(available, "available")?;
        let prefix_len = size(prefix_len, "prefix_len")?;
        let extend_len = size(extend_len, "extend_len")?;
        if extend_len < 1 {
            return bad("extend_len must be >= 1: every admitted request computes a token".into());
        }
        let mut max_new = size(max_new_tokens, "max_new_tokens")?.min(CLIP_MAX_NEW_TOKENS.into());
        if max_new > max_new_limit(available - self.total_offset, extend_len, self.ps) {
            return Ok((false, AddReqResult::NoToken, 0));
        }
        let paged = self.ceil_page(extend_len);
        let granted = match self.rem_chunk {
            Some(chunk) if paged > chunk => {
                let end = floor_div(prefix_len + self.floor_page(chunk), self.ps) * self.ps;
                if end - prefix_len <= 0 {
                    return Ok((false, AddReqResult::Other, 0));
                }
                max_new = 0;
                end - prefix_len
            }
            _ => {
                if self.num_admitted > 0 && paged >= self.rem_input {
                    return Ok((false, AddReqResult::Other, 0));
                }
                extend_len
            }
        };
        self.reserve(granted, max_new);
        Ok((true, self.state_of(available), granted))
    }

    /// The tokens `available` lacks for `add_req` to admit this request now by the memory rule
    /// (0 when it fits); charges nothing.
    pub fn shortfall(
        &self,
        available: i64,
        extend_len: i64,
        max_new_tokens: i64,
    ) -> CoreResult<i128> {
        let available = size(available, "available")?;
        let extend_len = size(extend_len, "extend_len")?;
        if extend_len < 1 {
            return bad("extend_len must be >= 1: every admitted request computes a token".into());
        }
        let max_new = size(max_new_tokens, "max_new_tokens")?.min(CLIP_MAX_NEW_TOKENS.into());
        let limit = max_new_limit(available - self.total_offset, extend_len, self.ps);
        Ok((max_new - limit).max(0))
    }

    /// Charge the next slice of the request being chunked: (state for the next one, granted).
    pub fn add_chunk(
        &mut self,
        available: i64,
        prefix_len: i64,
        remaining_len: i64,
        max_new_tokens: i64,
    ) -> CoreResult<(AddReqResult, i128)> {
        let available = size(available, "available")?;
        let prefix_len = size(prefix_len, "prefix_len")?;
        let remaining_len = size(remaining_len, "remaining_len")?;
        if remaining_len < 1 {
            return bad("remaining_len must be >= 1".into());
        }
        let Some(chunk) = self.rem_chunk else {
            return bad("add_chunk needs a chunk budget (rem_chunk_tokens is None)".into());
        };
        let mut max_new = size(max_new_tokens, "max_new_tokens")?.min(CLIP_MAX_NEW_TOKENS.into());
        let mut limit = chunk.min(available - self.total_offset);
        if limit <= 0 {
            limit = chunk;
        }
        let granted = if remaining_len <= limit {
            remaining_len
        } else {
            max_new = 0;
            let cut = floor_div(prefix_len + limit, self.ps) * self.ps - prefix_len;
            if cut > 0 {
                cut
            } else {
                // A continuing chunk must progress: fall back to the chunk budget.
                remaining_len.min(self.floor_page(chunk).max(self.ps))
            }
        };
        self.reserve(granted, max_new);
        Ok((self.state_of(available), granted))
    }

    fn state_of(&self, available: i128) -> AddReqResult {
        if available - self.total_offset <= 0 || available - self.current_offset <= 0 {
            return AddReqResult::NoToken;
        }
        if self.rem_input <= 0 || self.rem_chunk.is_some_and(|c| c <= 0) {
            return AddReqResult::Other;
        }
        AddReqResult::Continue
    }

    fn reserve(&mut self, extend_len: i128, max_new: i128) {
        let paged = self.ceil_page(extend_len);
        let immediate = paged + self.ps;
        self.total_offset += immediate + max_new;
        self.current_offset += immediate;
        self.rem_input -= paged;
        if let Some(chunk) = self.rem_chunk.as_mut() {
            *chunk -= paged;
        }
        self.num_admitted += 1;
    }

    fn ceil_page(&self, n: i128) -> i128 {
        -floor_div(-n, self.ps) * self.ps
    }

    fn floor_page(&self, n: i128) -> i128 {
        floor_div(n, self.ps) * self.ps
    }
}

/// Python's `//` for a positive divisor.
fn floor_div(a: i128, b: i128) -> i128 {
    a.div_euclid(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixed_decode_tokens_are_charged_up_front() {
        let b = PrefillBudget::new(1, 100, Some(50), 10).unwrap();
        assert_eq!((b.rem_input_tokens(), b.rem_chunk_tokens()), (90, Some(40)));
        assert_eq!((b.total_offset(), b.current_offset()), (10, 10));
    }

    #[test]
    fn reserve_running_clips_and_floors() {
        let mut b = PrefillBudget::new(1, 100, None, 0).unwrap();
        let got = b
            .reserve_running(&[10_000, 3, -5], &[false, false, true], 0.5)
            .unwrap();
        assert_eq!(got, 2048 + 1);
        assert_eq!(b.total_offset(), 2049);
        assert!(b.reserve_running(&[1], &[], 0.5).is_err());
        assert!(b.reserve_running(&[1], &[true], f64::NAN).is_err());
    }

    #[test]
    fn add_req_charges_pages_and_decode_tokens() {
        let mut b = PrefillBudget::new(16, 10_000, None, 0).unwrap();
        let (ok, state, granted) = b.add_req(100_000, 0, 20, 100).unwrap();
        assert!(ok);
        assert_eq!((state, granted), (AddReqResult::Continue, 20));
        assert_eq!(b.total_offset(), 32 + 16 + 100);
        assert_eq!(b.current_offset(), 48);
        assert_eq!(b.rem_input_tokens(), 10_000 - 32);
        // Not strictly under the remaining memory: NO_TOKEN.
        let avail = b.total_offset() as i64 + 10 + 5 + 16;
        assert_eq!(
            b.add_req(avail, 0, 10, 5).unwrap(),
            (false, AddReqResult::NoToken, 0)
        );
    }

    #[test]
    fn input_budget_refuses_all_but_the_first() {
        let mut b = PrefillBudget::new(1, 10, None, 0).unwrap();
        assert_eq!(
            b.add_req(1000, 0, 50, 0).unwrap(),
            (true, AddReqResult::Other, 50)
        );
        assert_eq!(
            b.add_req(1000, 0, 1, 0).unwrap(),
            (false, AddReqResult::Other, 0)
        );
    }

    #[test]
    fn chunking_cuts_on_a_page_boundary() {
        let mut b = PrefillBudget::new(4, 1000, Some(10), 0).unwrap();
        // prefix 2 + floor_page(10)=8 -> end 8 (page aligned) -> granted 6, no decode reserve.
        let (ok, state, granted) = b.add_req(10_000, 2, 30, 100).unwrap();
        assert!(ok);
        assert_eq!(granted, 6);
        assert_eq!(state, AddReqResult::Continue);
        assert_eq!(b.total_offset(), 8 + 4);
        assert_eq!(b.rem_chunk_tokens(), Some(2));
    }

    #[test]
    fn add_chunk_always_progresses() {
        let mut b = PrefillBudget::new(4, 1000, Some(3), 0).unwrap();
        let (_, granted) = b.add_chunk(10_000, 1, 100, 5).unwrap();
        assert_eq!(granted, 3); // (1 + 3) // 4 * 4 - 1
        let (_, granted) = b.add_chunk(10_000, 0, 100, 5).unwrap();
        assert_eq!(granted, 4); // cut is 0: max(floor_page(chunk), ps) = 4
        let mut off = PrefillBudget::new(4, 1000, None, 0).unwrap();
        assert!(off.add_chunk(10, 0, 1, 0).is_err());
    }

    #[test]
    fn negative_budgets_use_floor_division() {
        let b = PrefillBudget::new(4, 0, Some(0), 5).unwrap();
        assert_eq!(b.rem_chunk_tokens(), Some(-5));
        assert_eq!(b.floor_page(-5), -8);
        assert_eq!(b.ceil_page(-5), -4);
        assert_eq!(b.state(100).unwrap(), AddReqResult::Other);
    }

    #[test]
    fn max_new_tokens_limit_is_add_reqs_rule() {
        for ps in [1, 4, 16] {
            for (capacity, prompt_len) in [(64, 1), (64, 17), (1000, 333), (4000, 60)] {
                let limit = PrefillBudget::max_new_tokens_limit(capacity, ps, prompt_len).unwrap();
                assert_eq!(limit, i128::from(capacity - ps - prompt_len - 1));
                let max_new = i64::try_from(limit).unwrap();
                let mut b = PrefillBudget::new(ps, 10_000, None, 0).unwrap();
                assert!(b.add_req(capacity, 0, prompt_len, max_new).unwrap().0);
                let mut b = PrefillBudget::new(ps, 10_000, None, 0).unwrap();
                assert_eq!(
                    b.add_req(capacity, 0, prompt_len, max_new + 1).unwrap(),
                    (false, AddReqResult::NoToken, 0)
                );
            }
        }
        assert_eq!(PrefillBudget::max_new_tokens_limit(0, 1, 0).unwrap(), -2);
        assert!(PrefillBudget::max_new_tokens_limit(-1, 1, 0).is_err());
        assert!(PrefillBudget::max_new_tokens_limit(1, 0, 0).is_err());
        assert!(PrefillBudget::max_new_tokens_limit(1, 1, -1).is_err());
        let extreme = PrefillBudget::max_new_tokens_limit(0, i64::MAX, i64::MAX).unwrap();
        assert_eq!(extreme, -2 * i128::from(i64::MAX) - 1);
    }

    #[test]
    fn shortfall_is_the_distance_to_add_reqs_rule() {
        for ps in [1, 4, 16] {
            let mut b = PrefillBudget::new(ps, 10_000, None, 0).unwrap();
            b.reserve_running(&[300], &[true], 0.7).unwrap();
            for (avail, extend, max_new) in [(1000, 50, 100), (400, 50, 100), (300, 1, 9000)] {
                let short = b.shortfall(avail, extend, max_new).unwrap();
                let short_i64 = i64::try_from(short).unwrap();
                assert_eq!(
                    b.clone().add_req(avail, 0, extend, max_new).unwrap().0,
                    short == 0
                );
                if short > 0 {
                    let fits = b.clone().add_req(avail + short_i64, 0, extend, max_new);
                    assert!(fits.unwrap().0);
                    let still = b.clone().add_req(avail + short_i64 - 1, 0, extend, max_new);
                    assert!(!still.unwrap().0);
                }
            }
            assert_eq!(b.total_offset(), 300); // charges nothing
        }
        let b = PrefillBudget::new(1, 10, None, 0).unwrap();
        assert!(b.shortfall(10, 0, 1).is_err());
        assert!(b.shortfall(-1, 1, 1).is_err());
    }

    #[test]
    fn bad_sizes_are_rejected() {
        assert!(PrefillBudget::new(0, 1, None, 0).is_err());
        assert!(PrefillBudget::new(1, -1, None, 0).is_err());
        let mut b = PrefillBudget::new(1, 10, None, 0).unwrap();
        assert!(b.add_req(10, 0, 0, 0).is_err());
        assert!(b.state(-1).is_err());
    }
}
