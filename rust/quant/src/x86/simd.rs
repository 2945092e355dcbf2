//! The vector primitives the exact kernels are written in, per instruction set: f32 lanes
//! (`F32Lanes`: 16 for AVX-512, 8 for AVX2). All `#[inline(always)]`: they compile into the
//! `#[target_feature]` function that calls them.

use std::arch::x86_64::*;

use super::decode::levels8;

pub(crate) trait F32Lanes: Copy {
    type V: Copy;
    const WIDTH: usize;
    /// Vectors per 32-weight group.
    const PER_GROUP: usize = 32 / Self::WIDTH;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(v: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    /// `a * b + c`, one rounding.
    unsafe fn fmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn sum(v: Self::V) -> f32;
    /// The group's 32 weights, `PER_GROUP` vectors (the rest unused).
    unsafe fn weights(q: __m256i, signed: bool, s: [f32; 2], m: [f32; 2]) -> [Self::V; 4];
}

#[derive(Clone, Copy)]
pub(crate) struct Avx512;

#[derive(Clone, Copy)]
pub(crate) struct Avx2;

impl F32Lanes for Avx512 {
    type V = __m512;
    const WIDTH: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> __m512 {
        _mm512_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn sum(v: __m512) -> f32 {
        _mm512_reduce_add_ps(v)
    }
    #[inline(always)]
    unsafe fn weights(q: __m256i, signed: bool, s: [f32; 2], m: [f32; 2]) -> [__m512; 4] {
        let (lo, hi) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
        let widen = |p: __m128i| {
            _mm512_cvtepi32_ps(if signed {
                _mm512_cvtepi8_epi32(p)
            } else {
                _mm512_cvtepu8_epi32(p)
            })
        };
        let w0 = _mm512_fmadd_ps(widen(lo), _mm512_set1_ps(s[0]), _mm512_set1_ps(m[0]));
        let w1 = _mm512_fmadd_ps(widen(hi), _mm512_set1_ps(s[1]), _mm512_set1_ps(m[1]));
        [w0, w1, w0, w1]
    }
}

impl F32Lanes for Avx2 {
    type V = __m256;
    const WIDTH: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> __m256 {
        _mm256_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn sum(v: __m256) -> f32 {
        sum256(v)
    }
    #[inline(always)]
    unsafe fn weights(q: __m256i, signed: bool, s: [f32; 2], m: [f32; 2]) -> [__m256; 4] {
        let [a, b, c, d] = levels8(q, signed);
        let (s0, m0) = (_mm256_set1_ps(s[0]), _mm256_set1_ps(m[0]));
        let (s1, m1) = (_mm256_set1_ps(s[1]), _mm256_set1_ps(m[1]));
        [
            _mm256_fmadd_ps(a, s0, m0),
            _mm256_fmadd_ps(b, s0, m0),
            _mm256_fmadd_ps(c, s1, m1),
            _mm256_fmadd_ps(d, s1, m1),
        ]
    }
}

#[inline(always)]
pub(crate) unsafe fn sum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}
