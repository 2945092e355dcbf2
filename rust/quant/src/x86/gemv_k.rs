//! The exact decode GEMV for the k-quants on AVX-512 (`gemv_f32_k`): sub-block by sub-block,
//! 16 weights widened from the block's bytes, dequantized in one FMA and multiplied into each
//! row's accumulators (Q4_K / Q6_K: one core 13.7 -> 13.9 / 12 -> 15 GB/s over the generic
//! `gemv::gemv_f32`, two 20 -> 24 / 20 -> 26 GB/s; it stays bound by the conversions). The
//! default kernels are the panels' (`panel`); this one serves `--quant-kernel exact`.

use std::arch::x86_64::*;
use std::ops::Range;

use super::kfmt::KFmt;
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

/// The exact GEMV for the k-quants (module doc): each sub-block's 16 weights dequantized into
/// one vector (`scale * q + offset`, one rounding: `dequantize`'s values).
/// SAFETY: `p` checked by `matmul`; AVX-512 (F, BW, VL) available; no other thread writes
/// columns `rows` of y; `x0 + N <= p.n`.
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
