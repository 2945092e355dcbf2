//! The batched kernels: a tile of 32 rows of W is unpacked once per call into the layout of
//! the micro-kernel, and every row of x meets it, `MR` rows of x at a time in registers.
//!
//! `GemmInt8`: the tile holds the levels as bytes, group by group, 4 levels of each of the 32
//! rows per 128 bytes (`vpdpbusd`'s operand: 16 lanes of 4 bytes), with a scale (and an
//! offset) per row and 16 weights. A group's integer sums start from `-zero * sum(x levels)`
//! when the format's offset is a zero point (so the epilogue is a conversion and one FMA by
//! `scale_w * scale_x`); free offsets (Q4_1, Q5_1, Q4_K, Q5_K) add `offset * sum(x)`.
//! Q8_0's signed levels become unsigned (`q + 128`, zero point 128) for `vpdpbusd`; AVX2's
//! `pmaddubsw`, which saturates, keeps them signed.
//!
//! `GemmF32`: the tile is dequantized `KC` columns at a time into an f32 panel (32 outputs
//! per row of the panel) for a plain f32 micro-kernel.
//!
//! Results gather in a per-task `[n, 32]` buffer and go to y at the end, so a tile with
//! fewer than 32 rows of W never writes beyond its columns.

use std::arch::x86_64::*;
use std::ops::Range;

use super::decode::Fmt;
use super::simd::{F32Lanes, IntLanes};
use crate::act::Acts;
use crate::run::TILE_ROWS;
use crate::Problem;

/// The levels of a tile of W, as `IntLanes::dot4` reads them. Lanes of rows past the end of
/// W hold stale (initialized) values of an earlier tile: their results are never written.
#[derive(Default)]
pub(crate) struct Int8Tile {
    q: Vec<u8>,
    /// `[groups][2 halves][32 rows]`.
    scale: Vec<f32>,
    offset: Vec<f32>,
    /// The zero point folded into the integer sums (0: none).
    zero: i32,
    /// Whether the levels are signed bytes (Q8_0 on AVX2).
    signed: bool,
}

thread_local! {
    /// Each thread's tile, reused from call to call (no allocation or zeroing per tile).
    pub(crate) static TILE: std::cell::RefCell<Int8Tile> = std::cell::RefCell::default();
}

const GROUP_BYTES: usize = 32 * TILE_ROWS;

/// Rows `rows` of W (at most 32) into `tile`.
/// SAFETY: AVX2 (and the lanes' features).
#[inline(always)]
pub(crate) unsafe fn pack_int8<L: IntLanes, F: Fmt>(
    p: &Problem<'_>,
    rows: Range<usize>,
    tile: &mut Int8Tile,
) {
    let groups = p.w.cols / 32;
    let unsigned = F::SIGNED && !L::NARROW;
    let grow = |v: &mut Vec<f32>| v.resize(v.len().max(groups * 2 * TILE_ROWS), 0.0);
    tile.q.resize(tile.q.len().max(groups * GROUP_BYTES), 0);
    grow(&mut tile.scale);
    grow(&mut tile.offset);
    tile.zero = if unsigned { 128 } else { F::ZERO };
    tile.signed = F::SIGNED && L::NARROW;
    let (dst, scale, offset) = (
        tile.q.as_mut_ptr(),
        tile.scale.as_mut_ptr(),
        tile.offset.as_mut_ptr(),
    );
    let per_block = F::LEN / 32;
    // 8 rows at a time: their levels of a block side by side, then each group's 8 x 8
    // words transposed so that 4 levels of 8 rows are one 32-byte store.
    let mut levels = [[_mm256_setzero_si256(); 8]; 8]; // [row][group of the block]
    for i0 in (0..rows.len()).step_by(8) {
        let height = (rows.len() - i0).min(8);
        for b in 0..p.w.num_blocks() {
            for (i, row_levels) in levels.iter_mut().enumerate().take(height) {
                let row = p.w.row(rows.start + i0 + i).as_ptr();
                // 8 rows read side by side outrun the hardware prefetcher (2x slower from
                // DRAM than one row after the other): fetch 1 KiB ahead.
                let ahead = row.add(b * F::BYTES + 1024);
                _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(ahead.add(64) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(ahead.add(128) as *const i8);
                F::decode(
                    row.add(b * F::BYTES),
                    #[inline(always)]
                    |g, q, s, m| {
                        row_levels[g] = if unsigned {
                            _mm256_xor_si256(q, _mm256_set1_epi8(-128))
                        } else {
                            q
                        };
                        let gi = b * per_block + g;
                        for h in 0..2 {
                            *scale.add((2 * gi + h) * TILE_ROWS + i0 + i) = s[h];
                            *offset.add((2 * gi + h) * TILE_ROWS + i0 + i) = m[h];
                        }
                    },
                );
            }
            #[allow(clippy::needless_range_loop)] // g picks a column of `levels`
            for g in 0..per_block {
                let words = transpose8(std::array::from_fn(|i| levels[i][g]));
                let base = dst.add((b * per_block + g) * GROUP_BYTES + 4 * i0);
                for (k, w) in words.iter().enumerate() {
                    _mm256_storeu_si256(base.add(4 * TILE_ROWS * k) as *mut __m256i, *w);
                }
            }
        }
    }
}

/// The 8 x 8 matrix of 32-bit words in 8 registers, transposed.
#[inline(always)]
unsafe fn transpose8(r: [__m256i; 8]) -> [__m256i; 8] {
    let t: [__m256i; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_epi32(a, b)
        } else {
            _mm256_unpackhi_epi32(a, b)
        }
    });
    // u[4j + c]: words c and c + 4 of rows 4j .. 4j + 4.
    let u: [__m256i; 8] = std::array::from_fn(|i| {
        let (j, c) = (i / 4, i % 4);
        let (a, b) = (t[4 * j + c / 2], t[4 * j + 2 + c / 2]);
        if c % 2 == 0 {
            _mm256_unpacklo_epi64(a, b)
        } else {
            _mm256_unpackhi_epi64(a, b)
        }
    });
    std::array::from_fn(|k| {
        if k < 4 {
            _mm256_permute2x128_si256::<0x20>(u[k], u[4 + k])
        } else {
            _mm256_permute2x128_si256::<0x31>(u[k - 4], u[k])
        }
    })
}

/// Rows `x0 .. x0 + MR` of x against the tile, into `out` (`[n, 32]`).
/// SAFETY: the lanes' features; `acts` quantizes `p.x`; `x0 + MR <= p.n`.
#[inline(always)]
pub(crate) unsafe fn tile_int8<L: IntLanes, const HALVES: bool, const MR: usize>(
    p: &Problem<'_>,
    tile: &Int8Tile,
    acts: &Acts,
    x0: usize,
    out: &mut [f32],
) {
    type V<L> = <<L as IntLanes>::F as F32Lanes>::V;
    let vecs = TILE_ROWS / L::WIDTH;
    let cols = p.w.cols;
    let mut acc: [[V<L>; 4]; MR] = [[L::F::zero(); 4]; MR];
    let free_offset = tile.zero == 0 && !tile.signed;
    for g in 0..cols / 32 {
        for h in 0..if HALVES { 2 } else { 1 } {
            let mut sums = [[L::splat(0); 4]; MR];
            if tile.zero != 0 {
                for (r, sums_r) in sums.iter_mut().enumerate() {
                    let at = (x0 + r) * cols / 16 + 2 * g;
                    let level_sum = if HALVES {
                        acts.qsum16[at + h]
                    } else {
                        acts.qsum16[at] + acts.qsum16[at + 1]
                    };
                    *sums_r = [L::splat(-tile.zero * level_sum); 4];
                }
            }
            let steps = if HALVES { 4 * h..4 * h + 4 } else { 0..8 };
            for k in steps {
                let wp = tile.q.as_ptr().add(g * GROUP_BYTES + k * 4 * TILE_ROWS);
                let mut w = [L::splat(0); 4];
                for (t, wt) in w.iter_mut().enumerate().take(vecs) {
                    *wt = L::load(wp.add(4 * L::WIDTH * t));
                }
                for (r, sums_r) in sums.iter_mut().enumerate() {
                    let xp = acts.q.as_ptr().add((x0 + r) * cols + 32 * g + 4 * k);
                    let x4 = (xp as *const i32).read_unaligned();
                    for t in 0..vecs {
                        sums_r[t] = L::dot4(sums_r[t], w[t], x4, tile.signed);
                    }
                }
            }
            let at = (2 * g + h) * TILE_ROWS;
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let x_scale = L::F::splat(acts.scale[(x0 + r) * cols / 32 + g]);
                let x_sum = if free_offset {
                    let at = (x0 + r) * cols / 16 + 2 * g;
                    L::F::splat(if HALVES {
                        acts.sum16[at + h]
                    } else {
                        acts.sum16[at] + acts.sum16[at + 1]
                    })
                } else {
                    L::F::zero()
                };
                for t in 0..vecs {
                    let s = L::F::load(tile.scale.as_ptr().add(at + t * L::WIDTH));
                    let dot = L::F::mul(L::to_f32(sums[r][t]), x_scale);
                    acc_r[t] = L::F::fmadd(dot, s, acc_r[t]);
                    if free_offset {
                        let m = L::F::load(tile.offset.as_ptr().add(at + t * L::WIDTH));
                        acc_r[t] = L::F::fmadd(m, x_sum, acc_r[t]);
                    }
                }
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (t, v) in acc_r.iter().enumerate().take(vecs) {
            L::F::store(
                out.as_mut_ptr().add((x0 + r) * TILE_ROWS + t * L::WIDTH),
                *v,
            );
        }
    }
}

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
