//! The panel kernels (`crate::panel`'s layout): 16 rows of W in the 16 dword lanes of one
//! AVX-512 vector or two AVX2 ones (`Lanes`), each group of 32 columns 8 byte dot products
//! against 4 activation bytes broadcast to every lane, the sums scaled in f32 per group.
//!
//! One kernel, written once over the vectors (`lanes::Lanes`) and the format (`PFmt`).

use std::arch::x86_64::*;

pub(crate) use super::lanes::{Lanes, Ymm, Zmm};
use crate::format::QType;
use crate::panel::Panels;
use crate::panel_act::PanelActs;

/// A panel format, as the kernel reads a panel block (`crate::panel`'s layout).
pub(crate) trait PFmt {
    const QTYPE: QType;
    const G: usize = Self::QTYPE.groups();
    const GB: usize = Self::QTYPE.group_bytes();
    const ZERO: i32 = Self::QTYPE.zero_point();
    const MIN: bool = Self::QTYPE.has_min();
}

macro_rules! pfmt {
    ($($name:ident = $q:ident),*) => {$(
        pub(crate) struct $name;
        impl PFmt for $name {
            const QTYPE: QType = QType::$q;
        }
    )*};
}
pfmt!(
    P8_0 = Q8_0,
    P4_0 = Q4_0,
    P4_1 = Q4_1,
    P5_0 = Q5_0,
    P5_1 = Q5_1,
    P4K = Q4K,
    P5K = Q5K,
    P6K = Q6K
);

/// Calls `$body` with `$F` the panel format of `$qtype`.
macro_rules! with_pfmt {
    ($qtype:expr, $F:ident => $body:expr) => {
        match $qtype {
            $crate::format::QType::Q8_0 => {
                type $F = $crate::x86::panel::P8_0;
                $body
            }
            $crate::format::QType::Q4_0 => {
                type $F = $crate::x86::panel::P4_0;
                $body
            }
            $crate::format::QType::Q4_1 => {
                type $F = $crate::x86::panel::P4_1;
                $body
            }
            $crate::format::QType::Q5_0 => {
                type $F = $crate::x86::panel::P5_0;
                $body
            }
            $crate::format::QType::Q5_1 => {
                type $F = $crate::x86::panel::P5_1;
                $body
            }
            $crate::format::QType::Q4K => {
                type $F = $crate::x86::panel::P4K;
                $body
            }
            $crate::format::QType::Q5K => {
                type $F = $crate::x86::panel::P5K;
                $body
            }
            $crate::format::QType::Q6K => {
                type $F = $crate::x86::panel::P6K;
                $body
            }
        }
    };
}
pub(crate) use with_pfmt;

/// The 8 chunks (4 columns x 16 rows) of the group at `group`, as unsigned levels.
#[inline(always)]
unsafe fn chunks<L: Lanes, F: PFmt>(group: *const u8) -> [L::I; 8] {
    let mut ch = [L::zero(); 8];
    if F::QTYPE == QType::Q8_0 {
        for (c, v) in ch.iter_mut().enumerate() {
            *v = L::load(group.add(64 * c));
        }
        return ch;
    }
    let nib = L::splat8(0x0f);
    for j in 0..4 {
        let v = L::load(group.add(64 * j));
        ch[j] = L::and(v, nib);
        ch[j + 4] = L::and(L::srl16(v, 4), nib);
    }
    match F::QTYPE {
        QType::Q5_0 | QType::Q5_1 | QType::Q5K => {
            let (hb, bit) = (L::load(group.add(256)), L::splat8(0x10));
            for (c, v) in ch.iter_mut().enumerate() {
                let c = c as i32;
                let moved = if c <= 4 {
                    L::sll16(hb, 4 - c)
                } else {
                    L::srl16(hb, c - 4)
                };
                *v = L::or(*v, L::and(moved, bit));
            }
        }
        QType::Q6K => {
            let bits = L::splat8(0x30);
            for h in 0..2 {
                let hb = L::load(group.add(256 + 64 * h));
                for k in 0..4i32 {
                    let moved = if k <= 2 {
                        L::sll16(hb, 4 - 2 * k)
                    } else {
                        L::srl16(hb, 2)
                    };
                    let c = 4 * h + k as usize;
                    ch[c] = L::or(ch[c], L::and(moved, bits));
                }
            }
        }
        _ => {}
    }
    ch
}

/// The integer sums of each half (columns 0..16, 16..32) of the chunks against the 32
/// activation bytes at `x`, in two chains per half.
#[inline(always)]
unsafe fn sums<L: Lanes, F: PFmt>(ch: &[L::I; 8], x: *const i8) -> [L::I; 2] {
    let mut s = [L::zero(); 4];
    for (c, v) in ch.iter().enumerate() {
        let k = c / 4 * 2 + c % 2;
        s[k] = if F::QTYPE == QType::Q8_0 {
            L::dot_full(s[k], *v, x.add(4 * c))
        } else {
            L::dot(s[k], *v, x.add(4 * c))
        };
    }
    [L::add32(s[0], s[1]), L::add32(s[2], s[3])]
}

/// `sums` against the activations' group at `at` (`128 * hi + lo` for Int16).
#[inline(always)]
unsafe fn halves<L: Lanes, F: PFmt, const WIDE: bool>(
    ch: &[L::I; 8],
    a: &PanelActs,
    at: usize,
) -> [L::I; 2] {
    let lo = sums::<L, F>(ch, a.lo.as_ptr().add(at));
    if !WIDE {
        return lo;
    }
    let hi = sums::<L, F>(ch, a.hi.as_ptr().add(at));
    [L::combine(hi[0], lo[0]), L::combine(hi[1], lo[1])]
}

/// The sums of N rows at once (from the activations' offset `at` of row 0, rows `cols`
/// apart), chunk by chunk: one chain per row and byte plane (and half, for Q6_K), which with
/// three rows or more is enough in flight, and few enough registers that nothing spills
/// (the second half's entries are zero but for Q6_K).
#[inline(always)]
unsafe fn chunk_major<L: Lanes, F: PFmt, const N: usize, const WIDE: bool>(
    ch: &[L::I; 8],
    a: &PanelActs,
    at: usize,
    cols: usize,
) -> [[L::I; 2]; N] {
    let halves = F::QTYPE == QType::Q6K;
    let (lo, hi) = (a.lo.as_ptr().add(at), a.hi.as_ptr().wrapping_add(at));
    let dot = dot_levels::<L, F>;
    let mut out = [[L::zero(); 2]; N];
    let mut s_hi = [[L::zero(); 2]; N];
    for (c, v) in ch.iter().enumerate() {
        let h = if halves { c / 4 } else { 0 };
        for r in 0..N {
            let off = r * cols + 4 * c;
            out[r][h] = dot(out[r][h], *v, lo.add(off));
            if WIDE {
                s_hi[r][h] = dot(s_hi[r][h], *v, hi.add(off));
            }
        }
    }
    if WIDE {
        for r in 0..N {
            for h in 0..2 {
                out[r][h] = L::combine(s_hi[r][h], out[r][h]);
            }
        }
    }
    out
}

/// `L::dot`, or `dot_full` for Q8_0's 8-bit levels (a function, not a closure: a closure
/// does not get the caller's target features and its intrinsics would stay calls).
#[inline(always)]
unsafe fn dot_levels<L: Lanes, F: PFmt>(acc: L::I, v: L::I, x: *const i8) -> L::I {
    if F::QTYPE == QType::Q8_0 {
        L::dot_full(acc, v, x)
    } else {
        L::dot(acc, v, x)
    }
}

/// How far ahead of the block being read the kernel prefetches (past a panel's end: the next
/// panel's start, which the same thread reads next in its run; at worst a line nobody needs).
const PREFETCH_AHEAD: usize = 2048;

/// `y[x0 + r, 16 p ..] = x[x0 + r] . W[panel p]^T` for r < N.
/// SAFETY: the lanes' features available; `w`, `a` and y checked by the caller (`a` rounds
/// rows `x0 .. x0 + N` of x, y holds their panel's columns); no other thread writes them.
#[inline(always)]
pub(crate) unsafe fn panel_rows<L: Lanes, F: PFmt, const N: usize, const WIDE: bool>(
    w: &Panels<'_>,
    a: &PanelActs,
    p: usize,
    x0: usize,
    y: *mut f32,
    ld_y: usize,
) {
    let groups = w.cols / 32;
    let mut acc = [L::fzero(); N];
    let size = F::QTYPE.panel_block_bytes();
    for b in 0..w.num_blocks() {
        let blk = w.block(p, b).as_ptr();
        let ahead = blk.wrapping_add(PREFETCH_AHEAD);
        for line in (0..size).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line) as *const i8);
        }
        let tail = blk.add(F::G * F::GB);
        // per block: Q4_K / Q5_K's d and dmin, Q6_K's d; else the group's scales
        let (d, dmin) = match F::QTYPE {
            QType::Q4K | QType::Q5K => (L::f16(tail.add(256)), L::f16(tail.add(288))),
            QType::Q6K => (L::f16(tail.add(256)), L::fzero()),
            _ => (L::f16(tail), L::fzero()),
        };
        let min = if F::QTYPE.has_min() && F::G == 1 {
            L::f16(tail.add(32))
        } else {
            L::fzero()
        };
        for g in 0..F::G {
            let ch = chunks::<L, F>(blk.add(g * F::GB));
            let (sc, mn) = match F::QTYPE {
                QType::Q4K | QType::Q5K => (
                    L::mul(d, L::bytes(tail.add(16 * g), false)),
                    L::neg(L::mul(dmin, L::bytes(tail.add(128 + 16 * g), false))),
                ),
                QType::Q6K => (L::mul(d, L::bytes(tail.add(32 * g), true)), L::fzero()),
                _ => (d, min),
            };
            let sc2 = if F::QTYPE == QType::Q6K {
                L::mul(d, L::bytes(tail.add(32 * g + 16), true))
            } else {
                sc
            };
            let gi = b * F::G + g;
            let sums = if N >= 3 {
                chunk_major::<L, F, N, WIDE>(&ch, a, (x0 * w.cols) + 32 * gi, w.cols)
            } else {
                let mut sums = [[L::zero(); 2]; N];
                for (r, s) in sums.iter_mut().enumerate() {
                    *s = halves::<L, F, WIDE>(&ch, a, ((x0 + r) * groups + gi) * 32);
                }
                sums
            };
            for (r, (acc, [i0, i1])) in acc.iter_mut().zip(sums).enumerate() {
                let at = (x0 + r) * groups + gi;
                let xs = *a.scale.get_unchecked(at);
                let q = a.qsum.as_ptr().add(2 * at);
                if F::QTYPE == QType::Q6K {
                    *acc = L::fma(L::cvt(L::sub32(i0, 32 * *q)), L::scale(sc, xs), *acc);
                    *acc = L::fma(
                        L::cvt(L::sub32(i1, 32 * *q.add(1))),
                        L::scale(sc2, xs),
                        *acc,
                    );
                    continue;
                }
                let mut i = L::add32(i0, i1);
                if F::ZERO != 0 {
                    i = L::sub32(i, F::ZERO * (*q + *q.add(1)));
                }
                *acc = L::fma(L::cvt(i), L::scale(sc, xs), *acc);
                if F::MIN {
                    *acc = L::fma_s(mn, *a.xsum.get_unchecked(at), *acc);
                }
            }
        }
    }
    let count = w.panel_rows(p);
    for (r, acc) in acc.iter().enumerate() {
        L::store(y.add((x0 + r) * ld_y + 16 * p), *acc, count);
    }
}
