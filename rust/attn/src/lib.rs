//! Paged decode attention on the CPU, reading K/V in place from sglite's KV pool.
//!
//! Layout contract (checked by `validate`; the Python launcher checks dtypes and contiguity):
//! - `q`: `[n, num_heads, head_dim]`, `out`: `[n, num_heads, v_dim]`, row-major.
//! - `k`: one layer of the pool, `[num_slots, num_kv_heads, head_dim]`, row-major; `v`:
//!   `[num_slots, num_kv_heads, v_row]` with `v_row >= v_dim` (its rows' first `v_dim`
//!   elements are the values). A plain pool has `v_row = v_dim = head_dim`; MLA's latent pool
//!   passes its key rows as `v` too (`v_row = head_dim`, `v_dim = kv_lora_rank`: the values
//!   are the first dims of each key).
//! - `table`: the request-to-token table `[table_rows, table_width]` of i32 slot ids. Query
//!   `i` attends to the keys at slots `table[rows[i], 0 .. seq_lens[i]]`.
//! - GQA: query head `h` reads KV head `h / (num_heads / num_kv_heads)`.
//! - Per layer variations: a sliding window `W` (the plan's) keeps each row's last `W` keys
//!   only, `table[rows[i], max(0, seq_lens[i] - W) .. seq_lens[i]]`; a logit cap `c > 0`
//!   turns each score `s` into `c * tanh(s / c)` before the softmax; sinks (one logit per
//!   query head) join the softmax's denominator only.
//!
//! Why it exists: the torch path gathers every row's K/V into a padded copy in each layer
//! (read and write all of it, then SDPA reads it again). Here each K/V row is read once per
//! query row and nothing but the output is written.
//!
//! Work is split in tasks, one per (query row, KV head): the scores of the group's query
//! heads against every key, a softmax (its exp is a polynomial that vectorizes), then the
//! weighted sum of the values. Rows that share a cached prefix form a group: each block of
//! the prefix's keys is read once and used by every member, while it is in L1. Tasks (a group
//! and a KV head) are cut into ranges of about equal key count, one per thread (`pool`). The loops are compiled for AVX-512, for AVX2+FMA and for the baseline, and
//! the best the CPU has is chosen at run time.

pub mod contention;
mod elem;
mod exp;
pub mod fp8;
pub mod isa_cap;
pub(crate) mod kernel;
pub mod ops;
mod plan;
pub mod pool;
mod rope;
pub mod store;

use std::fmt;

pub use elem::{Bf16, E4m3, E5m2, Elem, Kind, KvElem};
pub use plan::DecodePlan;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// The values' (and the output's) head width, at most `head_dim`'s row of `v`.
    pub v_dim: usize,
}

impl Dims {
    /// Keys and values of one width (MHA, GQA, MQA).
    pub fn same(num_heads: usize, num_kv_heads: usize, head_dim: usize) -> Self {
        Dims {
            num_heads,
            num_kv_heads,
            head_dim,
            v_dim: head_dim,
        }
    }
}

/// One layer's decode attention, all inputs borrowed (`decode_attention` builds the plan and
/// runs it; a forward pass builds one `DecodePlan` and runs it for every layer instead).
pub struct Problem<'a, T, K = T> {
    pub q: &'a [T],
    pub k: &'a [K],
    pub v: &'a [K],
    pub table: &'a [i32],
    pub table_width: usize,
    pub rows: &'a [i64],
    pub seq_lens: &'a [i64],
    pub dims: Dims,
    pub scale: f32,
    /// Keep only each row's last `window` keys (None: all of them).
    pub window: Option<usize>,
    pub variant: Variant<'a>,
}

/// What a layer adds to softmax attention: a logit cap (0: none) and sinks (`[num_heads]`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Variant<'a> {
    pub logit_cap: f32,
    pub sinks: Option<&'a [f32]>,
}

/// What changes from layer to layer: the queries, this layer's pool and the head layout.
/// K/V may be stored narrower than q (`K`: an fp8 or bf16 pool under f32 queries).
pub struct Layer<'a, T, K = T> {
    pub q: &'a [T],
    pub k: &'a [K],
    pub v: &'a [K],
    pub dims: Dims,
    pub scale: f32,
    pub variant: Variant<'a>,
}

/// A violated layout contract; nothing was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttnError(pub String);

impl fmt::Display for AttnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for AttnError {}

pub(crate) fn err<T>(msg: String) -> Result<T, AttnError> {
    Err(AttnError(msg))
}

/// Attention of one query token per row; writes `out` (`[n, num_heads, v_dim]`).
pub fn decode_attention<T: Elem, K: KvElem>(
    p: &Problem<'_, T, K>,
    out: &mut [T],
    num_threads: usize,
) -> Result<(), AttnError> {
    let plan = DecodePlan::new(
        p.table,
        p.table_width,
        p.rows,
        p.seq_lens,
        p.dims.num_kv_heads,
        p.window,
    )?;
    let layer = Layer {
        q: p.q,
        k: p.k,
        v: p.v,
        dims: p.dims,
        scale: p.scale,
        variant: p.variant,
    };
    plan.run(&layer, out, num_threads)
}

#[cfg(test)]
mod tests;
