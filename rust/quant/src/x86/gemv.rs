//! The decode kernels: rows of W streamed once, each block decoded in registers and used for
//! every row of x (up to 8 rows at once; more go in passes of 8).
//!
//! `Gemv` turns a group's levels into 32 f32 weights (one FMA per vector: `scale * q +
//! offset`) and FMAs them into each row's accumulators, one row of W after the other (4 rows
//! of W side by side, for more FMA chains in flight, streamed from DRAM at a third of the
//! speed: 3 vs 11 GB/s, Q4_K 4096x4096, one core). `GemvInt8` takes the group's levels as
//! they are into an integer dot product with the row's int8 activations (8 lanes of 4
//! products), then one FMA by `scale_w * scale_x`; offsets meet the sums of x.

use std::arch::x86_64::*;
use std::ops::Range;

use super::decode::Fmt;
use super::simd::{Dot, F32Lanes};
use crate::act::Acts;
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

/// SAFETY: as `gemv_f32`, `acts` quantizes `p.x`, and `D` is available.
#[inline(always)]
pub(crate) unsafe fn gemv_int8<D: Dot, F: Fmt, const N: usize>(
    p: &Problem<'_>,
    acts: &Acts,
    rows: Range<usize>,
    x0: usize,
) {
    let cols = p.w.cols;
    let xq = acts.q.as_ptr().add(x0 * cols);
    let x_scale = acts.scale.as_ptr().add(x0 * cols / 32);
    let x_sum = acts.sum16.as_ptr().add(x0 * cols / 16);
    let chains = chains(N);
    for o in rows {
        let mut acc = [[_mm256_setzero_ps(); 4]; N];
        let mut offsets = [[0f32; 4]; N];
        let row = p.w.row(o).as_ptr();
        for b in 0..p.w.num_blocks() {
            prefetch(row.add(b * F::BYTES + PREFETCH_AHEAD));
            F::decode(
                row.add(b * F::BYTES),
                #[inline(always)]
                |g, q, s, m| {
                    let k = b * F::LEN + 32 * g;
                    let gi = k / 32;
                    let c = g % chains;
                    for r in 0..N {
                        let xv = _mm256_loadu_si256(xq.add(r * cols + k) as *const __m256i);
                        let dot = _mm256_cvtepi32_ps(D::dot(q, xv, F::SIGNED));
                        let xs = *x_scale.add(r * cols / 32 + gi);
                        let scale = if F::HALVES {
                            _mm256_setr_m128(_mm_set1_ps(s[0] * xs), _mm_set1_ps(s[1] * xs))
                        } else {
                            _mm256_set1_ps(s[0] * xs)
                        };
                        acc[r][c] = _mm256_fmadd_ps(dot, scale, acc[r][c]);
                        if !F::SIGNED {
                            let sums = x_sum.add(r * cols / 16 + 2 * gi);
                            offsets[r][c] += m[0] * *sums + m[1] * *sums.add(1);
                        }
                    }
                },
            );
        }
        for r in 0..N {
            let [a0, a1, a2, a3] = acc[r];
            let sum = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
            let [o0, o1, o2, o3] = offsets[r];
            *p.y.0.add((x0 + r) * p.ld_y + o) = super::simd::sum256(sum) + ((o0 + o1) + (o2 + o3));
        }
    }
}
