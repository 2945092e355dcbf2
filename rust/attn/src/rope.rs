//! The rotary embedding of q and k on the CPU, one pass over each head row (see `ops` for the
//! threading and rounding rules it shares with the other element-wise steps).

use crate::ops::{for_rows, RowJob, Shared};
use crate::{err, AttnError, Elem};

/// Where the rows of q or k are: `heads` heads of `head_dim` elements starting every
/// `row_stride` elements (a slice of the fused QKV projection, or a tensor of their own).
pub struct HeadRows<'a, T> {
    pub data: &'a [T],
    pub row_stride: usize,
    pub heads: usize,
}

/// Rotary embedding (the half-split "neox" layout) of q and k at `positions`, written to
/// `q_out` and `k_out` (`[tokens, heads, head_dim]`, contiguous). `table` holds one row of
/// `2 * head_dim` per position: `[cos | cos | -sin | sin]` (halves of `head_dim / 2`).
#[allow(clippy::too_many_arguments)]
pub fn rope<T: Elem>(
    positions: &[i64],
    table: &[T],
    q: &HeadRows<'_, T>,
    k: &HeadRows<'_, T>,
    q_out: &mut [T],
    k_out: &mut [T],
    head_dim: usize,
    threads: usize,
) -> Result<(), AttnError> {
    let tokens = positions.len();
    if head_dim == 0 || !head_dim.is_multiple_of(2) || !table.len().is_multiple_of(2 * head_dim) {
        return err(format!(
            "rope: head_dim {head_dim} must be even and the table rows of {}",
            2 * head_dim
        ));
    }
    let table_rows = table.len() / (2 * head_dim);
    if let Some(bad) = positions
        .iter()
        .find(|&&p| p < 0 || p as usize >= table_rows)
    {
        return err(format!(
            "rope: position {bad} is outside the table's 0..{table_rows}"
        ));
    }
    for (name, rows, out) in [("q", q, q_out.len()), ("k", k, k_out.len())] {
        let width = rows.heads * head_dim;
        let needed = if tokens == 0 {
            0
        } else {
            (tokens - 1) * rows.row_stride + width
        };
        if rows.row_stride < width || rows.data.len() < needed || out != tokens * width {
            return err(format!(
                "rope: {name} has {} elements (out {out}); {tokens} rows of {} heads x \
                 {head_dim} every {} elements need {needed} (out {})",
                rows.data.len(),
                rows.heads,
                rows.row_stride,
                tokens * width
            ));
        }
    }
    let job = RopeJob {
        positions,
        table,
        q,
        k,
        q_out: Shared(q_out.as_mut_ptr()),
        k_out: Shared(k_out.as_mut_ptr()),
        head_dim,
    };
    for_rows(tokens, (q.heads + k.heads) * head_dim, threads, &job);
    Ok(())
}

struct RopeJob<'a, T> {
    positions: &'a [i64],
    table: &'a [T],
    q: &'a HeadRows<'a, T>,
    k: &'a HeadRows<'a, T>,
    q_out: Shared<T>,
    k_out: Shared<T>,
    head_dim: usize,
}

impl<T: Elem> RowJob for RopeJob<'_, T> {
    #[inline(always)]
    unsafe fn run(&self, from: usize, to: usize) {
        let d = self.head_dim;
        for t in from..to {
            let at = self.positions[t] as usize * 2 * d;
            let (cos, sin) = self.table[at..at + 2 * d].split_at(d);
            for (rows, out) in [(self.q, self.q_out), (self.k, self.k_out)] {
                let width = rows.heads * d;
                let src = &rows.data[t * rows.row_stride..][..width];
                let dst = out.rows(t * width, width);
                for (x, o) in src.chunks_exact(d).zip(dst.chunks_exact_mut(d)) {
                    rotate(x, cos, sin, o);
                }
            }
        }
    }
}

/// `o = x * cos + [x2 | x1] * sin` for one head `x = [x1 | x2]`.
#[inline(always)]
fn rotate<T: Elem>(x: &[T], cos: &[T], sin: &[T], o: &mut [T]) {
    let half = x.len() / 2;
    let (x1, x2) = x.split_at(half);
    let (o1, o2) = o.split_at_mut(half);
    let (c1, c2) = cos[..2 * half].split_at(half);
    let (s1, s2) = sin[..2 * half].split_at(half);
    for j in 0..half {
        let (lo, hi) = (x1[j].to_f32(), x2[j].to_f32());
        o1[j] = T::from_f32(lo * c1[j].to_f32() + hi * s1[j].to_f32());
        o2[j] = T::from_f32(hi * c2[j].to_f32() + lo * s2[j].to_f32());
    }
}
