//! Paged decode attention on the CPU, reading K/V in place from sglite's KV pool.
//!
//! Layout contract (checked by `validate`; the Python launcher checks dtypes and contiguity):
//! - `q` and `out`: `[n, num_heads, head_dim]`, row-major.
//! - `k`, `v`: one layer of the pool, `[num_slots, num_kv_heads, head_dim]`, row-major.
//! - `table`: the request-to-token table `[table_rows, table_width]` of i32 slot ids. Query
//!   `i` attends to the keys at slots `table[rows[i], 0 .. seq_lens[i]]`.
//! - GQA: query head `h` reads KV head `h / (num_heads / num_kv_heads)`.
//!
//! Why it exists: the torch path gathers every row's K/V into a padded copy in each layer
//! (read and write all of it, then SDPA reads it again). Here each K/V row is read once per
//! query row and nothing but the output is written.
//!
//! Work is split in tasks, one per (query row, KV head): the scores of the group's query
//! heads against every key, a softmax (its exp is a polynomial that vectorizes), then the
//! weighted sum of the values. Rows that share a cached prefix form a group: each block of
//! the prefix's keys is read once and used by every member, while it is in L1. Tasks (a group
//! and a KV head) are cut into ranges of about equal key count, one per thread. The loops are compiled for AVX-512, for AVX2+FMA and for the baseline, and
//! the best the CPU has is chosen at run time.

mod exp;
mod kernel;

use std::fmt;

/// An element type of q, K, V and the output; math is in f32.
pub trait Elem: Copy + Send + Sync + 'static {
    /// bfloat16 bits (loaded by widening to f32), else f32 itself.
    const IS_BF16: bool;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl Elem for f32 {
    const IS_BF16: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

/// bfloat16 as its bit pattern (the top half of an f32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Elem for Bf16 {
    const IS_BF16: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
    /// Round to nearest, ties to even (what torch does); NaN stays NaN.
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        let bits = x.to_bits();
        if x.is_nan() {
            return Bf16(((bits >> 16) as u16) | 0x40);
        }
        let round = 0x7fff + ((bits >> 16) & 1);
        Bf16((bits.wrapping_add(round) >> 16) as u16)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// One layer's decode attention: the inputs, borrowed.
pub struct Problem<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub table: &'a [i32],
    pub table_width: usize,
    pub rows: &'a [i64],
    pub seq_lens: &'a [i64],
    pub dims: Dims,
    pub scale: f32,
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

fn err<T>(msg: String) -> Result<T, AttnError> {
    Err(AttnError(msg))
}

/// Below this many (key, KV head) pairs a second thread costs more than it saves.
const MIN_PARALLEL_WORK: usize = 8192;

/// Attention of one query token per row; writes `out` (`[n, num_heads, head_dim]`).
pub fn decode_attention<T: Elem>(
    p: &Problem<'_, T>,
    out: &mut [T],
    num_threads: usize,
) -> Result<(), AttnError> {
    validate(p, out.len())?;
    let groups = make_groups(p);
    let mut tasks = Vec::with_capacity(groups.len() * p.dims.num_kv_heads);
    let mut costs = Vec::with_capacity(tasks.capacity());
    for (g, group) in groups.iter().enumerate() {
        let cost: usize = group.members.iter().map(|&i| p.seq_lens[i] as usize).sum();
        for head in 0..p.dims.num_kv_heads {
            tasks.push(kernel::Task {
                group: g as u32,
                head: head as u32,
            });
            costs.push(cost);
        }
    }
    let threads = if costs.iter().sum::<usize>() < MIN_PARALLEL_WORK {
        1
    } else {
        num_threads.max(1)
    };
    let cuts = split_tasks(&costs, threads);
    let out = kernel::OutPtr(out.as_mut_ptr());
    let groups = &groups[..];
    std::thread::scope(|scope| {
        for range in cuts.windows(2).skip(1) {
            let mine = &tasks[range[0]..range[1]];
            // SAFETY: `out` was validated to hold every row's output; each (row, KV head) is
            // in exactly one task, so no two threads write the same element.
            scope.spawn(move || unsafe { kernel::run_tasks(p, groups, mine, out) });
        }
        // SAFETY: as above.
        unsafe { kernel::run_tasks(p, groups, &tasks[cuts[0]..cuts[1]], out) };
    });
    Ok(())
}

/// Most rows in one group (their scores must stay in the core's cache).
const MAX_GROUP: usize = 16;
/// The shortest shared prefix worth reading once for several rows.
const MIN_SHARED: usize = 16;

/// Rows grouped by shared prefix: rows starting at the same slot whose slot lists agree on
/// at least `MIN_SHARED` positions form a group (its `shared` is the common length); every
/// other row is a group of its own (`shared` 0).
fn make_groups<T>(p: &Problem<'_, T>) -> Vec<kernel::Group> {
    let slots_of = |i: usize| {
        let start = p.rows[i] as usize * p.table_width;
        &p.table[start..start + p.seq_lens[i] as usize]
    };
    let mut order: Vec<usize> = (0..p.rows.len()).collect();
    order.sort_by_key(|&i| (slots_of(i)[0], i));
    let mut groups = Vec::new();
    let mut at = 0;
    while at < order.len() {
        let lead = slots_of(order[at]);
        let (mut end, mut shared) = (at + 1, lead.len());
        while end < order.len() && end - at < MAX_GROUP {
            let other = slots_of(order[end]);
            let common = lead.iter().zip(other).take_while(|(a, b)| a == b).count();
            if common.min(shared) < MIN_SHARED {
                break;
            }
            shared = shared.min(common);
            end += 1;
        }
        let shared = if end - at > 1 { shared } else { 0 };
        groups.push(kernel::Group {
            members: order[at..end].to_vec(),
            shared,
        });
        at = end;
    }
    groups
}

fn validate<T>(p: &Problem<'_, T>, out_len: usize) -> Result<(), AttnError> {
    let Dims {
        num_heads,
        num_kv_heads,
        head_dim,
    } = p.dims;
    if num_kv_heads == 0 || head_dim == 0 || !num_heads.is_multiple_of(num_kv_heads) {
        return err(format!(
            "bad head layout: {num_heads} query heads, {num_kv_heads} KV heads, head_dim {head_dim}"
        ));
    }
    let n = p.rows.len();
    if p.seq_lens.len() != n {
        return err(format!("{n} rows but {} seq_lens", p.seq_lens.len()));
    }
    let q_len = n * num_heads * head_dim;
    if p.q.len() != q_len || out_len != q_len {
        return err(format!(
            "q has {} and out {out_len} elements; [{n}, {num_heads}, {head_dim}] needs {q_len}",
            p.q.len()
        ));
    }
    let slot_len = num_kv_heads * head_dim;
    if p.k.len() != p.v.len() || !p.k.len().is_multiple_of(slot_len) {
        return err(format!(
            "k has {} and v {} elements; both must be [num_slots, {num_kv_heads}, {head_dim}]",
            p.k.len(),
            p.v.len()
        ));
    }
    let num_slots = p.k.len() / slot_len;
    let width = p.table_width;
    if width == 0 || !p.table.len().is_multiple_of(width) {
        return err(format!(
            "table of {} entries is not [rows, {width}]",
            p.table.len()
        ));
    }
    let table_rows = p.table.len() / width;
    for (&row, &len) in p.rows.iter().zip(p.seq_lens) {
        if row < 0 || row as usize >= table_rows {
            return err(format!(
                "row {row} is outside the table's {table_rows} rows"
            ));
        }
        if len < 1 || len as usize > width {
            return err(format!("seq_len {len} is outside 1..={width}"));
        }
        let start = row as usize * width;
        let slots = &p.table[start..start + len as usize];
        if let Some(bad) = slots.iter().find(|&&s| s < 0 || s as usize >= num_slots) {
            return err(format!(
                "slot {bad} of row {row} is outside the pool's {num_slots} slots"
            ));
        }
    }
    Ok(())
}

/// Boundaries `[0, .., costs.len()]` of at most `threads` contiguous ranges of about equal cost.
fn split_tasks(costs: &[usize], threads: usize) -> Vec<usize> {
    let total: usize = costs.iter().sum();
    let mut cuts = vec![0];
    let mut done = 0usize;
    for (task, cost) in costs.iter().enumerate() {
        done += cost;
        let next = cuts.len();
        if next < threads && done * threads >= total * next && task + 1 < costs.len() {
            cuts.push(task + 1);
        }
    }
    cuts.push(costs.len());
    cuts
}

#[cfg(test)]
mod tests;
