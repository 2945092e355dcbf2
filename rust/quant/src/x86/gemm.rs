//! The exact batched kernel over the file's blocks (`--quant-kernel exact`): a tile of 32 rows
//! of W is dequantized `KC` columns at a time into an f32 panel (32 outputs per row of the
//! panel) for a plain f32 micro-kernel, and every row of x meets it, `MR` rows at a time.
//!
//! Results gather in a per-task `[n, 32]` buffer and go to y at the end, so a tile with
//! fewer than 32 rows of W never writes beyond its columns.

use std::ops::Range;

use super::decode::Fmt;
use super::simd::F32Lanes;
use crate::run::TILE_ROWS;
use crate::Problem;

/// Columns of W per f32 panel: a multiple of every block, 64 KiB of panel.
pub(crate) const KC: usize = 512;

/// Rows `rows` of W, columns `k0 .. k0 + kc`, dequantized into `panel[k][i]` (32 per k).
/// SAFETY: AVX2, FMA, F16C (and `L`'s features); `k0` and `kc` are multiples of the block.
#[inline(always)]
pub(crate) unsafe fn pack_f32<L: F32Lanes, F: Fmt>(
    p: &Problem<'_>,
    rows: Range<usize>,
    k0: usize,
    kc: usize,
    panel: &mut [f32],
) {
    panel[..kc * TILE_ROWS].fill(0.0);
    let dst = panel.as_mut_ptr();
    for (i, o) in rows.enumerate() {
        let row = p.w.row(o).as_ptr();
        for b in k0 / F::LEN..(k0 + kc) / F::LEN {
            F::decode(
                row.add(b * F::BYTES),
                #[inline(always)]
                |g, q, s, m| {
                    let k = b * F::LEN + 32 * g - k0;
                    let mut vals = [0f32; 32];
                    for (j, v) in L::weights(q, F::SIGNED, s, m)
                        .into_iter()
                        .enumerate()
                        .take(L::PER_GROUP)
                    {
                        L::store(vals.as_mut_ptr().add(j * L::WIDTH), v);
                    }
                    for (l, v) in vals.into_iter().enumerate() {
                        *dst.add((k + l) * TILE_ROWS + i) = v;
                    }
                },
            );
        }
    }
}

/// `out[x0 .. x0 + MR] += x[x0 .. x0 + MR, k0 .. k0 + kc] . panel`.
/// SAFETY: `L`'s features; `x0 + MR <= p.n`.
#[inline(always)]
pub(crate) unsafe fn tile_f32<L: F32Lanes, const MR: usize>(
    p: &Problem<'_>,
    panel: &[f32],
    k0: usize,
    kc: usize,
    x0: usize,
    out: &mut [f32],
) {
    let vecs = TILE_ROWS / L::WIDTH;
    let cols = p.w.cols;
    let mut acc = [[L::zero(); 4]; MR];
    let o = out.as_mut_ptr();
    for (r, acc_r) in acc.iter_mut().enumerate() {
        for (t, a) in acc_r.iter_mut().enumerate().take(vecs) {
            *a = L::load(o.add((x0 + r) * TILE_ROWS + t * L::WIDTH));
        }
    }
    let x = p.x.as_ptr().add(x0 * cols + k0);
    for k in 0..kc {
        let wp = panel.as_ptr().add(k * TILE_ROWS);
        let mut w = [L::zero(); 4];
        for (t, wt) in w.iter_mut().enumerate().take(vecs) {
            *wt = L::load(wp.add(t * L::WIDTH));
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let xv = L::splat(*x.add(r * cols + k));
            for t in 0..vecs {
                acc_r[t] = L::fmadd(w[t], xv, acc_r[t]);
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (t, a) in acc_r.iter().enumerate().take(vecs) {
            L::store(o.add((x0 + r) * TILE_ROWS + t * L::WIDTH), *a);
        }
    }
}

/// Columns `rows` of y from the task's `[n, 32]` results.
/// SAFETY: `p` checked; this task alone writes these columns.
pub(crate) unsafe fn write_out(p: &Problem<'_>, rows: Range<usize>, out: &[f32]) {
    let width = rows.len();
    for r in 0..p.n {
        let src = &out[r * TILE_ROWS..][..width];
        let dst = p.y.0.add(r * p.ld_y + rows.start);
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst, width);
    }
}
