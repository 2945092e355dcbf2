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
//! - `whole_life_need` / `add_req_whole_life`: the starvation fix (scheduler/admission.py): a
//!   request the memory rule refuses is admitted when its whole life fits in `available` beside
//!   what everything charged can still grow while it lives (never cut).
//! - `add_chunk`: the next slice of the request being chunked; it always progresses.
//!
//! Sizes are i64 at the edge and i128 inside, so no sum can overflow.

use crate::error::{bad, CoreResult};

pub const CLIP_MAX_NEW_TOKENS: i64 = 4096;
/// Decode steps a request may outlive its max_new_tokens by in the scheduler's view (its finish
/// is seen one step late under the overlap loop; the prefill step is one more).
pub const LIFE_SLACK_STEPS: i64 = 2;

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
    /// remaining_new_tokens of the running batch (not clipped).
    running_remaining: Vec<i128>,
    /// (prompt still to come, max_new_tokens not clipped) of each charge in this batch.
    charged_future: Vec<(i128, i128)>,
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
            running_remaining: Vec::new(),
            charged_future: Vec::new(),
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
        self.running_remaining
            .extend(remaining_new_tokens.iter().map(|&r| i128::from(r.max(0))));
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
        let max_new_full = size(max_new_tokens, "max_new_tokens")?;
        let mut max_new = max_new_full.min(CLIP_MAX_NEW_TOKENS.into());
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
        self.charged_future
            .push((extend_len - granted, max_new_full));
        Ok((true, self.state_of(available), granted))
    }

    /// The tokens this request needs free now for its whole life to fit beside everything
    /// charged and what that can still grow while it lives; charges nothing.
    pub fn whole_life_need(&self, extend_len: i64, max_new_tokens: i64) -> CoreResult<i128> {
        let extend_len = size(extend_len, "extend_len")?;
        if extend_len < 1 {
            return bad("extend_len must be >= 1: every admitted request computes a token".into());
        }
        let max_new = size(max_new_tokens, "max_new_tokens")?;
        Ok(self.life_need(extend_len, max_new))
    }

    /// Admit a request the memory rule refused when its whole life fits in `available`; never
    /// cut. (admitted, state for the next one, granted extend length).
    pub fn add_req_whole_life(
        &mut self,
        available: i64,
        prefix_len: i64,
        extend_len: i64,
        max_new_tokens: i64,
    ) -> CoreResult<(bool, AddReqResult, i128)> {
        let available = size(available, "available")?;
        size(prefix_len, "prefix_len")?;
        let extend_len = size(extend_len, "extend_len")?;
        if extend_len < 1 {
            return bad("extend_len must be >= 1: every admitted request computes a token".into());
        }
        let max_new = size(max_new_tokens, "max_new_tokens")?;
        if self.life_need(extend_len, max_new) > available {
            return Ok((false, AddReqResult::NoToken, 0));
        }
        let paged = self.ceil_page(extend_len);
        if self.rem_chunk.is_some_and(|c| paged > c)
            || (self.num_admitted > 0 && paged >= self.rem_input)
        {
            return Ok((false, AddReqResult::Other, 0));
        }
        self.reserve(extend_len, max_new.min(CLIP_MAX_NEW_TOKENS.into()));
        self.charged_future.push((0, max_new));
        Ok((true, self.state_of(available), extend_len))
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
        let max_new_full = size(max_new_tokens, "max_new_tokens")?;
        let mut max_new = max_new_full.min(CLIP_MAX_NEW_TOKENS.into());
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
        self.charged_future
            .push((remaining_len - granted, max_new_full));
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

    fn life_need(&self, extend_len: i128, max_new: i128) -> i128 {
        let life = max_new + i128::from(LIFE_SLACK_STEPS);
        let ps = self.ps;
        let mut need = self.current_offset + self.ceil_page(extend_len + max_new) + ps;
        for &r in &self.running_remaining {
            need += self.ceil_page(r.min(life)) + ps;
        }
        for &(pending, new) in &self.charged_future {
            need += self.ceil_page(pending) + self.ceil_page(new.min(life)) + ps;
        }
        need
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
mod tests;
