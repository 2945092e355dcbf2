//! The k-quant super-blocks (Q4_K, Q5_K, Q6_K) as the AVX-512 GEMVs of `gemv_k` read them:
//! scales and offsets in vectors, and the levels in the orders those kernels multiply them.

use std::arch::x86_64::*;

use super::decode::{k4_scale_vectors, Fmt, Q4K, Q5K, Q6K};

/// A k-quant super-block as the kernels of `gemv_k` read it.
pub(crate) trait KFmt: Fmt {
    /// The scale and the offset of each 16-weight sub-block (`w = scale * q + offset`).
    /// SAFETY: AVX-512 (F, BW, VL) available; a block's bytes readable at `b`.
    unsafe fn scales16(b: *const u8) -> (__m512, __m512);
    /// Levels 16i .. 16i + 16 (sub-block i), one per 32-bit lane, widened straight from the
    /// block's bytes. SAFETY: as `scales16`.
    unsafe fn levels16(b: *const u8, i: usize) -> __m512i;
    /// Whether a scale covers a group of 32 weights, two sub-blocks (Q4_K, Q5_K): then the
    /// int8 kernel takes the 8 of `scales8` times the activations' per-32 scales.
    const PAIRED: bool = false;
    /// The 8 groups' scales and offsets. SAFETY: as `scales16`; `PAIRED`.
    unsafe fn scales8(b: *const u8) -> (__m256, __m256) {
        let _ = b;
        unreachable!("only the paired formats have 8 scales")
    }
    /// Levels 4k .. 4k + 4 of each sub-block, sub-block i in dword lane i (the order of
    /// `Acts::arrange_k`), unsigned. SAFETY: as `scales8`.
    unsafe fn levels_k(b: *const u8, k: usize) -> __m512i {
        let _ = (b, k);
        unreachable!("only the paired formats")
    }
    /// Levels 64c .. 64c + 64 (groups 2c and 2c + 1) in the file's order, unsigned, for
    /// `gemv_int8_k16`. SAFETY: as `scales16`; not `PAIRED`.
    unsafe fn levels64(b: *const u8, c: usize) -> __m512i {
        let _ = (b, c);
        unreachable!("only the unpaired formats")
    }
}

/// The two 64-byte halves of the 128 bytes at `p`, as one 32-dword table for
/// `_mm512_permutex2var_epi32`.
#[inline(always)]
unsafe fn halves(p: *const u8) -> (__m512i, __m512i) {
    (
        _mm512_loadu_si512(p as *const _),
        _mm512_loadu_si512(p.add(64) as *const _),
    )
}

/// Dword lane i: `idx(i)` (a constant where `idx` folds to one).
#[inline(always)]
pub(crate) unsafe fn lanes(idx: impl Fn(i32) -> i32) -> __m512i {
    _mm512_setr_epi32(
        idx(0),
        idx(1),
        idx(2),
        idx(3),
        idx(4),
        idx(5),
        idx(6),
        idx(7),
        idx(8),
        idx(9),
        idx(10),
        idx(11),
        idx(12),
        idx(13),
        idx(14),
        idx(15),
    )
}

/// Q4_K / Q5_K nibbles at `qs` (128 bytes): sub-block i = 2g + t is half t of group g, the low
/// (even g) or high nibbles of the 32 bytes at 32 * (g / 2); its levels 4k .. 4k + 4 are the
/// dword 8 (g / 2) + 4t + k.
#[inline(always)]
unsafe fn k4_levels_k(qs: *const u8, k: usize) -> __m512i {
    let (a, b) = halves(qs);
    let k = k as i32;
    let idx = lanes(|i| 8 * (i / 4) + 4 * (i % 2) + k);
    let shift = lanes(|i| 4 * ((i / 2) % 2));
    let raw = _mm512_permutex2var_epi32(a, idx, b);
    _mm512_and_si512(_mm512_srlv_epi32(raw, shift), _mm512_set1_epi8(0x0f))
}

/// The 16 bytes at `p`, one per 32-bit lane.
#[inline(always)]
unsafe fn widen16(p: *const u8) -> __m512i {
    _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))
}

/// Sub-block i's nibbles of Q4_K / Q5_K levels at `qs`: group i / 2 is the low (even groups)
/// or high nibbles of the 32 bytes at 32 * (i / 4), half i % 2 of them.
#[inline(always)]
unsafe fn k4_nibbles16(qs: *const u8, i: usize) -> __m512i {
    let (g, h) = (i / 2, i % 2);
    let bytes = widen16(qs.add(32 * (g / 2) + 16 * h));
    let shifted = if g % 2 == 1 {
        _mm512_srli_epi32::<4>(bytes)
    } else {
        bytes
    };
    _mm512_and_si512(shifted, _mm512_set1_epi32(0x0f))
}

/// Each of 8 values twice: a group's scale for its two sub-blocks.
#[inline(always)]
unsafe fn pairs(v: __m256) -> __m512 {
    let idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(v))
}

/// The 32 bytes at `p` in both halves of a vector.
#[inline(always)]
unsafe fn both_halves(p: *const u8) -> __m512i {
    _mm512_broadcast_i64x4(_mm256_loadu_si256(p as *const __m256i))
}

#[inline(always)]
unsafe fn k4_scales16(b: *const u8) -> (__m512, __m512) {
    let (scales, mins) = k4_scale_vectors(b);
    (pairs(scales), pairs(mins))
}

impl KFmt for Q4K {
    #[inline(always)]
    unsafe fn scales16(b: *const u8) -> (__m512, __m512) {
        k4_scales16(b)
    }
    const PAIRED: bool = true;
    #[inline(always)]
    unsafe fn scales8(b: *const u8) -> (__m256, __m256) {
        k4_scale_vectors(b)
    }
    #[inline(always)]
    unsafe fn levels_k(b: *const u8, k: usize) -> __m512i {
        k4_levels_k(b.add(16), k)
    }
    #[inline(always)]
    unsafe fn levels16(b: *const u8, i: usize) -> __m512i {
        k4_nibbles16(b.add(16), i)
    }
}

impl KFmt for Q5K {
    #[inline(always)]
    unsafe fn scales16(b: *const u8) -> (__m512, __m512) {
        k4_scales16(b)
    }
    const PAIRED: bool = true;
    #[inline(always)]
    unsafe fn scales8(b: *const u8) -> (__m256, __m256) {
        k4_scale_vectors(b)
    }
    #[inline(always)]
    unsafe fn levels_k(b: *const u8, k: usize) -> __m512i {
        let q = k4_levels_k(b.add(48), k);
        // group g's fifth bits: bit g of the 32 bytes at 16; sub-block 2g + t's levels
        // 4k .. 4k + 4 in dword 4t + k of them
        let qh = _mm512_castsi256_si512(_mm256_loadu_si256(b.add(16) as *const __m256i));
        let k = k as i32;
        let fifth = _mm512_permutexvar_epi32(lanes(|i| 4 * (i % 2) + k), qh);
        let set = _mm512_test_epi8_mask(fifth, lanes(|i| 0x0101_0101 << (i / 2)));
        _mm512_mask_add_epi8(q, set, q, _mm512_set1_epi8(0x10))
    }
    #[inline(always)]
    unsafe fn levels16(b: *const u8, i: usize) -> __m512i {
        let (g, h) = (i / 2, i % 2);
        let fifth = _mm512_srl_epi32(widen16(b.add(16 + 16 * h)), _mm_cvtsi32_si128(g as i32));
        let fifth = _mm512_slli_epi32::<4>(_mm512_and_si512(fifth, _mm512_set1_epi32(1)));
        _mm512_or_si512(k4_nibbles16(b.add(48), i), fifth)
    }
}

impl KFmt for Q6K {
    #[inline(always)]
    unsafe fn scales16(b: *const u8) -> (__m512, __m512) {
        let d = _mm512_set1_ps(super::decode::half(b.add(208)));
        let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(192) as *const __m128i));
        let scales = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), d);
        (scales, _mm512_mul_ps(scales, _mm512_set1_ps(-32.0)))
    }
    #[inline(always)]
    unsafe fn levels64(b: *const u8, c: usize) -> __m512i {
        // Groups 4h + 2t and 4h + 2t + 1: the low (t = 0) or high nibbles of the 64 bytes at
        // 64h, and bits 4t (+ 2) of the 32 bytes at 128 + 32h.
        let (h, t) = (c / 2, (c % 2) as i16);
        let ql = _mm512_loadu_si512(b.add(64 * h) as *const __m512i);
        let nib = _mm512_and_si512(
            _mm512_srlv_epi16(ql, _mm512_set1_epi16(4 * t)),
            _mm512_set1_epi8(0x0f),
        );
        let shift = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_set1_epi16(4 * t)),
            _mm256_set1_epi16(4 * t + 2),
        );
        let top = _mm512_and_si512(
            _mm512_srlv_epi16(both_halves(b.add(128 + 32 * h)), shift),
            _mm512_set1_epi8(3),
        );
        _mm512_or_si512(nib, _mm512_slli_epi16::<4>(top))
    }
    #[inline(always)]
    unsafe fn levels16(b: *const u8, i: usize) -> __m512i {
        // Group g = 4h + s: the low (s < 2) or high nibbles of the 32 bytes at 64h + 32(s % 2),
        // and bits 2s, 2s + 1 of the 32 bytes at 128 + 32h; half i % 2 of each.
        let (g, half) = (i / 2, i % 2);
        let (h, s) = (g / 4, g % 4);
        let ql = widen16(b.add(64 * h + 32 * (s % 2) + 16 * half));
        let nib = if s >= 2 {
            _mm512_srli_epi32::<4>(ql)
        } else {
            ql
        };
        let qh = widen16(b.add(128 + 32 * h + 16 * half));
        let top = _mm512_srl_epi32(qh, _mm_cvtsi32_si128(2 * s as i32));
        _mm512_or_si512(
            _mm512_and_si512(nib, _mm512_set1_epi32(0x0f)),
            _mm512_slli_epi32::<4>(_mm512_and_si512(top, _mm512_set1_epi32(3))),
        )
    }
}

/// Calls `$body` with `$F` the `KFmt` of `$qtype`, or evaluates `$other` for the other types.
macro_rules! with_kfmt {
    ($qtype:expr, $F:ident => $body:expr, _ => $other:expr) => {{
        use $crate::format::QType as T;
        use $crate::x86::decode as d;
        match $qtype {
            T::Q4K => {
                type $F = d::Q4K;
                $body
            }
            T::Q5K => {
                type $F = d::Q5K;
                $body
            }
            T::Q6K => {
                type $F = d::Q6K;
                $body
            }
            _ => $other,
        }
    }};
}
pub(crate) use with_kfmt;
