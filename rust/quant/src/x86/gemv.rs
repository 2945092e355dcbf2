//! The exact decode kernel over the file's blocks: rows of W streamed once, each block decoded
//! in registers and used for every row of x (up to 8 rows at once; more go in passes of 8).
//!
//! `gemv_f32` turns a group's levels into 32 f32 weights (one FMA per vector: `scale * q +
//! offset`) and FMAs them into each row's accumulators, one row of W after the other (4 rows
//! of W side by side, for more FMA chains in flight, streamed from DRAM at a third of the
//! speed: 3 vs 11 GB/s, Q4_K 4096x4096, one core).

use std::arch::x86_64::*;
use std::ops::Range;

use super::decode::Fmt;
use super::simd::F32Lanes;
use crate::Problem;

/// How far ahead of a block its row is prefetched: without, 2 rows of x took 1.7x as long
/// per row of W as with (Q4_0 4096x4096 from DRAM, one core).
pub(crate) const PREFETCH_AHEAD: usize = 2048;

/// Prefetched as non-temporal: a decode step streams the whole model (4 GB for a 7B) past
/// the caches once, and with the default hint those lines evicted everything else from L2
/// and L3 (the Python between the matmuls, x, the KV pool, the next op's code), which then
/// ran from DRAM. A 7B Q4_K_M batch-1 decode step on a 2-core EPYC (Zen 4): 207-209 ->
/// 180-186 ms, the matmuls 176-180 -> 157-159 ms (runs alternated); no change measured on
/// the Xeon these kernels were first tuned on.
#[inline(always)]
pub(crate) unsafe fn prefetch(p: *const u8) {
    _mm_prefetch::<_MM_HINT_NTA>(p as *const i8);
}

/// Independent accumulators per row of x for `n` rows: a group's FMA waits for the previous
/// one into the same register (4 cycles), so one row alone needs several chains in flight;
/// at 8 rows the rows themselves are enough (and the registers are spoken for).
#[inline(always)]
const fn chains(n: usize) -> usize {
    match n {
        1 | 2 => 4,
        3 | 4 => 2,
        _ => 1,
    }
}

/// Rows of x per pass.
pub(crate) const MAX_N: usize = 8;

/// SAFETY: `p` checked by `matmul`; `L` (and the caller's target features) available; no
/// other thread writes columns `rows` of y; `x0 + N <= p.n`.
#[inline(always)]
pub(crate) unsafe fn gemv_f32<L: F32Lanes, F: Fmt, const N: usize>(
    p: &Problem<'_>,
    rows: Range<usize>,
    x0: usize,
) {
    let cols = p.w.cols;
    let x = p.x.as_ptr().add(x0 * cols);
    let chains = chains(N);
    for o in rows {
        let mut acc = [[L::zero(); 4]; N];
        let row = p.w.row(o).as_ptr();
        for b in 0..p.w.num_blocks() {
            prefetch(row.add(b * F::BYTES + PREFETCH_AHEAD));
            F::decode(
                row.add(b * F::BYTES),
                #[inline(always)]
                |g, q, s, m| {
                    let k = b * F::LEN + 32 * g;
                    let weights = L::weights(q, F::SIGNED, s, m);
                    for (j, wv) in weights.iter().enumerate().take(L::PER_GROUP) {
                        let c = (g * L::PER_GROUP + j) % chains;
                        for (r, acc_r) in acc.iter_mut().enumerate() {
                            let xv = L::load(x.add(r * cols + k + j * L::WIDTH));
                            acc_r[c] = L::fmadd(*wv, xv, acc_r[c]);
                        }
                    }
                },
            );
        }
        for (r, acc_r) in acc.iter().enumerate() {
            let sum = L::add(L::add(acc_r[0], acc_r[1]), L::add(acc_r[2], acc_r[3]));
            *p.y.0.add((x0 + r) * p.ld_y + o) = L::sum(sum);
        }
    }
}
