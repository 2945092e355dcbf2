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
//! weighted sum of the values. Tasks are cut into contiguous ranges of about equal key count,
//! one per thread. The loops are compiled for AVX-512, for AVX2+FMA and for the baseline, and
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
    let kv_heads = p.dims.num_kv_heads;
    let task_len = out.len() / (p.rows.len() * kv_heads).max(1);
    let work: usize = p.seq_lens.iter().map(|&l| l as usize).sum::<usize>() * kv_heads;
    let threads = if work < MIN_PARALLEL_WORK {
        1
    } else {
        num_threads.max(1)
    };
    let cuts = split_tasks(p.seq_lens, kv_heads, threads);
    std::thread::scope(|scope| {
        let mut rest = &mut *out;
        let mut mine = None;
        for (t, range) in cuts.windows(2).enumerate() {
            let (first, last) = (range[0], range[1]);
            let (chunk, tail) = rest.split_at_mut((last - first) * task_len);
            rest = tail;
            if t == 0 {
                mine = Some((first, last, chunk));
            } else {
                scope.spawn(move || kernel::run_tasks(p, first, last, chunk));
            }
        }
        if let Some((first, last, chunk)) = mine {
            kernel::run_tasks(p, first, last, chunk);
        }
    });
    Ok(())
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

/// Task boundaries `[0, .., n * kv_heads]`: `threads` ranges of about equal key count.
fn split_tasks(seq_lens: &[i64], kv_heads: usize, threads: usize) -> Vec<usize> {
    let num_tasks = seq_lens.len() * kv_heads;
    let total: usize = seq_lens.iter().map(|&l| l as usize).sum::<usize>() * kv_heads;
    let mut cuts = vec![0];
    let mut done = 0usize;
    for task in 0..num_tasks {
        done += seq_lens[task / kv_heads] as usize;
        let next = cuts.len();
        if next < threads && done * threads >= total * next && task + 1 < num_tasks {
            cuts.push(task + 1);
        }
    }
    cuts.push(num_tasks);
    cuts
}

#[cfg(test)]
mod tests;
