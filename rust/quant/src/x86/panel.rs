//! The panel kernels (`crate::panel`'s layout): 16 rows of W in the 16 dword lanes of one
//! AVX-512 vector or two AVX2 ones (`Lanes`), each group of 32 columns 8 byte dot products
//! against 4 activation bytes broadcast to every lane, the sums scaled in f32 per group.
//!
//! One kernel, written once over `Lanes` and the format (`PFmt`); the byte dot product is
//! `vpdpbusd` (AVX-512 VNNI, or AVX-VNNI on 256 bits) or `vpmaddubsw` + `vpmaddwd` (AVX2):
//! the latter saturates at 16 bits, which 6-bit levels times a signed byte never reach; Q8_0's
//! 8-bit levels go through it as two nibbles (`Lanes::dot_full`).

use std::arch::x86_64::*;

use crate::format::QType;
use crate::panel::Panels;
use crate::panel_act::PanelActs;

/// 16 dword lanes of integers (`I`, 64 bytes) or f32 (`F`).
pub(crate) trait Lanes: Copy {
    type I: Copy;
    type F: Copy;
    unsafe fn load(p: *const u8) -> Self::I;
    unsafe fn zero() -> Self::I;
    unsafe fn splat8(v: i8) -> Self::I;
    unsafe fn and(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn or(a: Self::I, b: Self::I) -> Self::I;
    /// Each 16-bit lane shifted (`s` < 16; a constant once inlined).
    unsafe fn srl16(a: Self::I, s: i32) -> Self::I;
    unsafe fn sll16(a: Self::I, s: i32) -> Self::I;
    /// `acc` plus, in each dword lane, its 4 level bytes (unsigned, below 64) times the 4
    /// signed bytes at `x`.
    unsafe fn dot(acc: Self::I, levels: Self::I, x: *const i8) -> Self::I;
    /// As `dot`, levels up to 255.
    unsafe fn dot_full(acc: Self::I, levels: Self::I, x: *const i8) -> Self::I;
    unsafe fn add32(a: Self::I, b: Self::I) -> Self::I;
    /// `128 * hi + lo`.
    unsafe fn combine(hi: Self::I, lo: Self::I) -> Self::I;
    unsafe fn sub32(a: Self::I, v: i32) -> Self::I;
    unsafe fn fzero() -> Self::F;
    unsafe fn cvt(a: Self::I) -> Self::F;
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn neg(a: Self::F) -> Self::F;
    /// `a * s`.
    unsafe fn scale(a: Self::F, s: f32) -> Self::F;
    /// `a * b + c`.
    unsafe fn fma(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// `a * s + c`.
    unsafe fn fma_s(a: Self::F, s: f32, c: Self::F) -> Self::F;
    /// 16 f16 at `p`.
    unsafe fn f16(p: *const u8) -> Self::F;
    /// 16 u8 (`signed`: i8) at `p`.
    unsafe fn bytes(p: *const u8, signed: bool) -> Self::F;
    /// The first `count` (1..=16) lanes to `p`.
    unsafe fn store(p: *mut f32, v: Self::F, count: usize);
}

#[derive(Clone, Copy)]
pub(crate) struct Zmm;

impl Lanes for Zmm {
    type I = __m512i;
    type F = __m512;
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m512i {
        _mm512_loadu_si512(p as *const __m512i)
    }
    #[inline(always)]
    unsafe fn zero() -> __m512i {
        _mm512_setzero_si512()
    }
    #[inline(always)]
    unsafe fn splat8(v: i8) -> __m512i {
        _mm512_set1_epi8(v)
    }
    #[inline(always)]
    unsafe fn and(a: __m512i, b: __m512i) -> __m512i {
        _mm512_and_si512(a, b)
    }
    #[inline(always)]
    unsafe fn or(a: __m512i, b: __m512i) -> __m512i {
        _mm512_or_si512(a, b)
    }
    #[inline(always)]
    unsafe fn srl16(a: __m512i, s: i32) -> __m512i {
        _mm512_srl_epi16(a, _mm_cvtsi32_si128(s))
    }
    #[inline(always)]
    unsafe fn sll16(a: __m512i, s: i32) -> __m512i {
        _mm512_sll_epi16(a, _mm_cvtsi32_si128(s))
    }
    #[inline(always)]
    unsafe fn dot(acc: __m512i, levels: __m512i, x: *const i8) -> __m512i {
        _mm512_dpbusd_epi32(
            acc,
            levels,
            _mm512_set1_epi32((x as *const i32).read_unaligned()),
        )
    }
    #[inline(always)]
    unsafe fn dot_full(acc: __m512i, levels: __m512i, x: *const i8) -> __m512i {
        Self::dot(acc, levels, x)
    }
    #[inline(always)]
    unsafe fn add32(a: __m512i, b: __m512i) -> __m512i {
        _mm512_add_epi32(a, b)
    }
    #[inline(always)]
    unsafe fn combine(hi: __m512i, lo: __m512i) -> __m512i {
        _mm512_add_epi32(_mm512_slli_epi32::<7>(hi), lo)
    }
    #[inline(always)]
    unsafe fn sub32(a: __m512i, v: i32) -> __m512i {
        _mm512_sub_epi32(a, _mm512_set1_epi32(v))
    }
    #[inline(always)]
    unsafe fn fzero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn cvt(a: __m512i) -> __m512 {
        _mm512_cvtepi32_ps(a)
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn neg(a: __m512) -> __m512 {
        _mm512_sub_ps(_mm512_setzero_ps(), a)
    }
    #[inline(always)]
    unsafe fn scale(a: __m512, s: f32) -> __m512 {
        _mm512_mul_ps(a, _mm512_set1_ps(s))
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn fma_s(a: __m512, s: f32, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, _mm512_set1_ps(s), c)
    }
    #[inline(always)]
    unsafe fn f16(p: *const u8) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    #[inline(always)]
    unsafe fn bytes(p: *const u8, signed: bool) -> __m512 {
        let b = _mm_loadu_si128(p as *const __m128i);
        let i = if signed {
            _mm512_cvtepi8_epi32(b)
        } else {
            _mm512_cvtepu8_epi32(b)
        };
        _mm512_cvtepi32_ps(i)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512, count: usize) {
        if count >= 16 {
            _mm512_storeu_ps(p, v)
        } else {
            _mm512_mask_storeu_ps(p, ((1u32 << count) - 1) as u16, v)
        }
    }
}

/// Two AVX2 vectors: rows 0..8, then 8..16. `VNNI`: `vpdpbusd` on 256 bits (AVX-VNNI).
#[derive(Clone, Copy)]
pub(crate) struct Ymm<const VNNI: bool>;

/// `[e(0), e(1)]` for the two halves, written out: a closure would not get the caller's
/// target features, and the intrinsics in it would stay calls (30x slower).
macro_rules! pair {
    (|$h:ident| $e:expr) => {
        [
            {
                let $h = 0usize;
                $e
            },
            {
                let $h = 1usize;
                $e
            },
        ]
    };
}

impl<const VNNI: bool> Ymm<VNNI> {
    #[inline(always)]
    unsafe fn dot1(acc: __m256i, levels: __m256i, x: __m256i) -> __m256i {
        if VNNI {
            _mm256_dpbusd_avx_epi32(acc, levels, x)
        } else {
            let pairs = _mm256_maddubs_epi16(levels, x);
            _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }
    }
}

impl<const VNNI: bool> Lanes for Ymm<VNNI> {
    type I = [__m256i; 2];
    type F = [__m256; 2];
    #[inline(always)]
    unsafe fn load(p: *const u8) -> Self::I {
        pair!(|h| _mm256_loadu_si256(p.add(32 * h) as *const __m256i))
    }
    #[inline(always)]
    unsafe fn zero() -> Self::I {
        [_mm256_setzero_si256(); 2]
    }
    #[inline(always)]
    unsafe fn splat8(v: i8) -> Self::I {
        [_mm256_set1_epi8(v); 2]
    }
    #[inline(always)]
    unsafe fn and(a: Self::I, b: Self::I) -> Self::I {
        pair!(|h| _mm256_and_si256(a[h], b[h]))
    }
    #[inline(always)]
    unsafe fn or(a: Self::I, b: Self::I) -> Self::I {
        pair!(|h| _mm256_or_si256(a[h], b[h]))
    }
    #[inline(always)]
    unsafe fn srl16(a: Self::I, s: i32) -> Self::I {
        pair!(|h| _mm256_srl_epi16(a[h], _mm_cvtsi32_si128(s)))
    }
    #[inline(always)]
    unsafe fn sll16(a: Self::I, s: i32) -> Self::I {
        pair!(|h| _mm256_sll_epi16(a[h], _mm_cvtsi32_si128(s)))
    }
    #[inline(always)]
    unsafe fn dot(acc: Self::I, levels: Self::I, x: *const i8) -> Self::I {
        let xv = _mm256_set1_epi32((x as *const i32).read_unaligned());
        pair!(|h| Self::dot1(acc[h], levels[h], xv))
    }
    #[inline(always)]
    unsafe fn dot_full(acc: Self::I, levels: Self::I, x: *const i8) -> Self::I {
        if VNNI {
            return Self::dot(acc, levels, x);
        }
        // 16 * high nibble + low nibble: each product stays within vpmaddubsw's 16 bits
        let xv = _mm256_set1_epi32((x as *const i32).read_unaligned());
        let nib = _mm256_set1_epi8(0x0f);
        pair!(|h| {
            let lo = Self::dot1(_mm256_setzero_si256(), _mm256_and_si256(levels[h], nib), xv);
            let high = _mm256_and_si256(_mm256_srli_epi16::<4>(levels[h]), nib);
            let hi = Self::dot1(_mm256_setzero_si256(), high, xv);
            _mm256_add_epi32(acc[h], _mm256_add_epi32(_mm256_slli_epi32::<4>(hi), lo))
        })
    }
    #[inline(always)]
    unsafe fn add32(a: Self::I, b: Self::I) -> Self::I {
        pair!(|h| _mm256_add_epi32(a[h], b[h]))
    }
    #[inline(always)]
    unsafe fn combine(hi: Self::I, lo: Self::I) -> Self::I {
        pair!(|h| _mm256_add_epi32(_mm256_slli_epi32::<7>(hi[h]), lo[h]))
    }
    #[inline(always)]
    unsafe fn sub32(a: Self::I, v: i32) -> Self::I {
        pair!(|h| _mm256_sub_epi32(a[h], _mm256_set1_epi32(v)))
    }
    #[inline(always)]
    unsafe fn fzero() -> Self::F {
        [_mm256_setzero_ps(); 2]
    }
    #[inline(always)]
    unsafe fn cvt(a: Self::I) -> Self::F {
        pair!(|h| _mm256_cvtepi32_ps(a[h]))
    }
    #[inline(always)]
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F {
        pair!(|h| _mm256_mul_ps(a[h], b[h]))
    }
    #[inline(always)]
    unsafe fn neg(a: Self::F) -> Self::F {
        pair!(|h| _mm256_sub_ps(_mm256_setzero_ps(), a[h]))
    }
    #[inline(always)]
    unsafe fn scale(a: Self::F, s: f32) -> Self::F {
        pair!(|h| _mm256_mul_ps(a[h], _mm256_set1_ps(s)))
    }
    #[inline(always)]
    unsafe fn fma(a: Self::F, b: Self::F, c: Self::F) -> Self::F {
        pair!(|h| _mm256_fmadd_ps(a[h], b[h], c[h]))
    }
    #[inline(always)]
    unsafe fn fma_s(a: Self::F, s: f32, c: Self::F) -> Self::F {
        pair!(|h| _mm256_fmadd_ps(a[h], _mm256_set1_ps(s), c[h]))
    }
    #[inline(always)]
    unsafe fn f16(p: *const u8) -> Self::F {
        pair!(|h| _mm256_cvtph_ps(_mm_loadu_si128(p.add(16 * h) as *const __m128i)))
    }
    #[inline(always)]
    unsafe fn bytes(p: *const u8, signed: bool) -> Self::F {
        pair!(|h| {
            let b = _mm_loadl_epi64(p.add(8 * h) as *const __m128i);
            let i = if signed {
                _mm256_cvtepi8_epi32(b)
            } else {
                _mm256_cvtepu8_epi32(b)
            };
            _mm256_cvtepi32_ps(i)
        })
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::F, count: usize) {
        if count >= 16 {
            _mm256_storeu_ps(p, v[0]);
            _mm256_storeu_ps(p.add(8), v[1]);
            return;
        }
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (h, half) in v.iter().enumerate() {
            let left = count as i32 - 8 * h as i32;
            let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), lanes);
            _mm256_maskstore_ps(p.add(8 * h), mask, *half);
        }
    }
}

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
    let mut s_lo = [[L::zero(); 2]; N];
    let mut s_hi = [[L::zero(); 2]; N];
    for (c, v) in ch.iter().enumerate() {
        let h = if halves { c / 4 } else { 0 };
        for r in 0..N {
            let off = r * cols + 4 * c;
            s_lo[r][h] = if F::QTYPE == QType::Q8_0 {
                L::dot_full(s_lo[r][h], *v, lo.add(off))
            } else {
                L::dot(s_lo[r][h], *v, lo.add(off))
            };
            if WIDE {
                s_hi[r][h] = if F::QTYPE == QType::Q8_0 {
                    L::dot_full(s_hi[r][h], *v, hi.add(off))
                } else {
                    L::dot(s_hi[r][h], *v, hi.add(off))
                };
            }
        }
    }
    let mut out = [[L::zero(); 2]; N];
    for r in 0..N {
        for h in 0..2 {
            out[r][h] = if WIDE {
                L::combine(s_hi[r][h], s_lo[r][h])
            } else {
                s_lo[r][h]
            };
        }
    }
    out
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
