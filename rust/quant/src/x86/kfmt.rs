//! The k-quant super-blocks (Q4_K, Q5_K, Q6_K) as the exact AVX-512 GEMV of `gemv_k` reads
//! them: scales and offsets in vectors, the levels one sub-block at a time.

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
