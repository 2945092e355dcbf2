//! The int8 decode GEMV for the k-quants on AVX-512: a super-block's work in whole vectors.
//!
//! The generic `gemv::gemv_int8` handles one 32-weight group at a time: a 256-bit dot product,
//! then a scalar product of the two scales, a broadcast and an FMA per group, and two scalar
//! FMAs for the offset, about 14 instructions per 16 bytes of Q4_K. Here a super-block (256
//! weights) is four 512-bit dot products of 64 levels against 64 activations.
//!
//! Q4_K and Q5_K (`gemv_int8_k`) take them in an order of our choosing (`KFmt::levels_k`, the
//! activations in the same order, `Acts::arrange_k`): dword lane i of each product holds 4
//! weights of sub-block i, so the four add up in int32 (exactly) and meet the scales in one
//! conversion and one FMA per super-block: the 8 group scales times the activations' per-32
//! scales, paired over the lanes, and the 8 offsets times the activations' 32-value sums.
//! Q6_K (`gemv_int8_k16`) takes them in the file's order, two groups per product, each
//! product converted and scaled on its own, the 16 sub-block scales spread to its lanes. The
//! values are those of the generic kernel (same levels, same f32 scale products); only the
//! order of f32 additions differs. Measured, one core: the file's order took Q4_K / Q6_K
//! 4096x4096 from DRAM from 15 / 11 to 28 / 31 GB/s over the generic kernel on a Xeon; on a
//! Zen 4, whose 512-bit operations take two passes, Q4_K 1024x4096 from cache ran at 136 us
//! a call in the file's order and at 100 in this one (Q6_K in this order: 128 vs 122).
//!
//! `gemv_f32_k` is the exact kernel's twin: sub-block by sub-block, 16 weights widened from
//! the block's bytes, dequantized in one FMA and multiplied into each row's accumulators (Q4_K
//! / Q6_K: one core 13.7 -> 13.9 / 12 -> 15 GB/s, two 20 -> 24 / 20 -> 26 GB/s: it stays
//! bound by the conversions, two instructions per weight vector that the int8 kernel skips).

use std::arch::x86_64::*;
use std::ops::Range;

use super::kfmt::{lanes, KFmt};
use crate::act::Acts;
use crate::Problem;

/// `$body` once for each listed `$i`, as a constant: the sub-block loops must unroll for the
/// format's shifts and offsets to fold (as a loop, the 16 sub-blocks ran at half the speed).
macro_rules! unroll {
    ($i:ident in [$($n:literal),*] => $body:block) => {
        $({
            const $i: usize = $n;
            $body
        })*
    };
}

/// The super-blocks of a row per pass over a task's rows: `N` rows of x at `x_bytes` a value
/// must stay in L1 (32 KiB of 48) while W's rows stream past them. Eight rows of a 4096-wide
/// x in f32 are 128 KiB, read from L2 for every row of W without this: the exact kernel took
/// 5.3 ms for 16 rows of x by 4096x4096 Q4_K, 3.0 with it.
#[inline(always)]
fn pass_blocks(n: usize, x_bytes: usize, blocks: usize) -> usize {
    ((32 << 10) / (n * x_bytes * 256)).clamp(1, blocks.max(1))
}

/// `y[r][o] = v` for the first pass over a row's columns, `+= v` after.
#[inline(always)]
unsafe fn put(p: &Problem<'_>, r: usize, o: usize, first: bool, v: f32) {
    let dst = p.y.0.add(r * p.ld_y + o);
    *dst = if first { v } else { *dst + v };
}

/// SAFETY: `p` checked by `matmul`; AVX-512 (F, BW, VL, VNNI) available; no other thread
/// writes columns `rows` of y; `acts` quantizes `p.x` and has `qk` (`Acts::arrange_k`);
/// `x0 + N <= p.n`.
#[inline(always)]
pub(crate) unsafe fn gemv_int8_k<F: KFmt, const N: usize>(
    p: &Problem<'_>,
    acts: &Acts,
    rows: Range<usize>,
    x0: usize,
) {
    if !F::PAIRED {
        return gemv_int8_k16::<F, N>(p, acts, rows, x0);
    }
    let cols = p.w.cols;
    debug_assert_eq!(acts.qk.len(), acts.q.len());
    let xq = acts.qk.as_ptr().add(x0 * cols);
    let (scale16, sum16) = (acts.scale16.as_ptr(), acts.sum16.as_ptr());
    let (scale32, sum32) = (acts.scale.as_ptr(), acts.sum32.as_ptr());
    let pairs = lanes(|i| i / 2);
    let blocks = p.w.num_blocks();
    let step = pass_blocks(N, 1, blocks);
    for b0 in (0..blocks).step_by(step) {
        for o in rows.clone() {
            let mut acc = [_mm512_setzero_ps(); N];
            let mut off = [_mm512_setzero_ps(); N];
            let mut off8 = [_mm256_setzero_ps(); N];
            let row = p.w.row(o).as_ptr();
            for b in b0..(b0 + step).min(blocks) {
                let blk = row.add(b * F::BYTES);
                super::gemv::prefetch(blk.add(super::gemv::PREFETCH_AHEAD));
                super::gemv::prefetch(blk.add(super::gemv::PREFETCH_AHEAD + 64));
                let mut dot = [_mm512_setzero_si512(); N];
                unroll!(K in [0, 1, 2, 3] => {
                    let q = F::levels_k(blk, K);
                    for (r, dot_r) in dot.iter_mut().enumerate() {
                        let x = _mm512_loadu_si512(xq.add(r * cols + 256 * b + 64 * K) as *const _);
                        *dot_r = _mm512_dpbusd_epi32(*dot_r, q, x);
                    }
                });
                // the sub-blocks' scales times the activations', one per lane
                let mut scale = [_mm512_setzero_ps(); N];
                if F::PAIRED {
                    let (s8, m8) = F::scales8(blk);
                    for r in 0..N {
                        let at = (x0 + r) * cols / 32 + 8 * b;
                        let s = _mm256_mul_ps(s8, _mm256_loadu_ps(scale32.add(at)));
                        scale[r] = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(s));
                        off8[r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(sum32.add(at)), off8[r]);
                    }
                } else {
                    let (s16, m16) = F::scales16(blk);
                    for r in 0..N {
                        let at = (x0 + r) * cols / 16 + 16 * b;
                        scale[r] = _mm512_mul_ps(s16, _mm512_loadu_ps(scale16.add(at)));
                        off[r] = _mm512_fmadd_ps(m16, _mm512_loadu_ps(sum16.add(at)), off[r]);
                    }
                }
                for r in 0..N {
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), scale[r], acc[r]);
                }
            }
            for r in 0..N {
                let sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], off[r]));
                put(p, x0 + r, o, b0 == 0, sum + super::simd::sum256(off8[r]));
            }
        }
    }
}

/// `gemv_int8_k` for Q6_K, in the file's order: each product of 64 levels (two groups)
/// converted and scaled on its own, the 16 sub-block scales spread to its lanes by one
/// permute (an order like `levels_k`'s costs Q6_K's nibbles and top bits two permutes per
/// product, which took longer: Zen 4, 1024x4096 from cache, 128 vs 122 us a call).
/// SAFETY: as `gemv_int8_k`, without `qk`.
#[inline(always)]
unsafe fn gemv_int8_k16<F: KFmt, const N: usize>(
    p: &Problem<'_>,
    acts: &Acts,
    rows: Range<usize>,
    x0: usize,
) {
    let cols = p.w.cols;
    let xq = acts.q.as_ptr().add(x0 * cols);
    let x_scale = acts.scale16.as_ptr().add(x0 * cols / 16);
    let x_sum = acts.sum16.as_ptr().add(x0 * cols / 16);
    // Lane l of product c holds sub-block 4c + l / 4.
    let spread: [__m512i; 4] = std::array::from_fn(|c| {
        let s = 4 * c as i32;
        _mm512_setr_epi32(
            s,
            s,
            s,
            s,
            s + 1,
            s + 1,
            s + 1,
            s + 1,
            s + 2,
            s + 2,
            s + 2,
            s + 2,
            s + 3,
            s + 3,
            s + 3,
            s + 3,
        )
    });
    let zero = _mm512_setzero_si512();
    let blocks = p.w.num_blocks();
    let step = pass_blocks(N, 1, blocks);
    for b0 in (0..blocks).step_by(step) {
        for o in rows.clone() {
            let mut acc = [[_mm512_setzero_ps(); 2]; N];
            let mut off = [_mm512_setzero_ps(); N];
            let row = p.w.row(o).as_ptr();
            for b in b0..(b0 + step).min(blocks) {
                let blk = row.add(b * F::BYTES);
                super::gemv::prefetch(blk.add(super::gemv::PREFETCH_AHEAD));
                super::gemv::prefetch(blk.add(super::gemv::PREFETCH_AHEAD + 64));
                let (s16, m16) = F::scales16(blk);
                let mut scale = [_mm512_setzero_ps(); N];
                for r in 0..N {
                    let at = r * cols / 16 + 16 * b;
                    scale[r] = _mm512_mul_ps(s16, _mm512_loadu_ps(x_scale.add(at)));
                    off[r] = _mm512_fmadd_ps(m16, _mm512_loadu_ps(x_sum.add(at)), off[r]);
                }
                unroll!(C in [0, 1, 2, 3] => {
                    let q = F::levels64(blk, C);
                    for r in 0..N {
                        let x = _mm512_loadu_si512(xq.add(r * cols + 256 * b + 64 * C) as *const _);
                        let dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, q, x));
                        let s = _mm512_permutexvar_ps(spread[C], scale[r]);
                        acc[r][C % 2] = _mm512_fmadd_ps(dot, s, acc[r][C % 2]);
                    }
                });
            }
            for r in 0..N {
                let sum = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), off[r]);
                put(p, x0 + r, o, b0 == 0, _mm512_reduce_add_ps(sum));
            }
        }
    }
}

/// The exact GEMV for the k-quants (module doc): each sub-block's 16 weights dequantized into
/// one vector (`scale * q + offset`, one rounding: `dequantize`'s values).
/// SAFETY: as `gemv_int8_k`, without `acts`.
#[inline(always)]
pub(crate) unsafe fn gemv_f32_k<F: KFmt, const N: usize>(
    p: &Problem<'_>,
    rows: Range<usize>,
    x0: usize,
) {
    let cols = p.w.cols;
    let x = p.x.as_ptr().add(x0 * cols);
    let blocks = p.w.num_blocks();
    let step = pass_blocks(N, 4, blocks);
    for b0 in (0..blocks).step_by(step) {
        for o in rows.clone() {
            let mut acc = [[_mm512_setzero_ps(); 4]; N];
            let row = p.w.row(o).as_ptr();
            for b in b0..(b0 + step).min(blocks) {
                let blk = row.add(b * F::BYTES);
                super::gemv::prefetch(blk.add(super::gemv::PREFETCH_AHEAD));
                super::gemv::prefetch(blk.add(super::gemv::PREFETCH_AHEAD + 64));
                // The scales from memory: a broadcast load is no shuffle (permutes were the limit).
                let (mut s16, mut m16) = ([0f32; 16], [0f32; 16]);
                let (sv, mv) = F::scales16(blk);
                _mm512_storeu_ps(s16.as_mut_ptr(), sv);
                _mm512_storeu_ps(m16.as_mut_ptr(), mv);
                unroll!(I in [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15] => {
                    let q = _mm512_cvtepi32_ps(F::levels16(blk, I));
                    let w = _mm512_fmadd_ps(q, _mm512_set1_ps(s16[I]), _mm512_set1_ps(m16[I]));
                    for (r, acc_r) in acc.iter_mut().enumerate() {
                        let xv = _mm512_loadu_ps(x.add(r * cols + 256 * b + 16 * I));
                        acc_r[I % 4] = _mm512_fmadd_ps(w, xv, acc_r[I % 4]);
                    }
                });
            }
            for (r, [a0, a1, a2, a3]) in acc.iter().enumerate() {
                let sum = _mm512_add_ps(_mm512_add_ps(*a0, *a1), _mm512_add_ps(*a2, *a3));
                put(p, x0 + r, o, b0 == 0, _mm512_reduce_add_ps(sum));
            }
        }
    }
}
