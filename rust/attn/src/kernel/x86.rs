//! AVX-512 and AVX2 forms of the kernel's dot product and value accumulation (the compiler
//! turns the portable loops into 2-lane pieces). bfloat16 is widened to f32 on load.

use std::arch::x86_64::*;

use super::{axpy, dot, Isa};
use crate::Elem;

#[derive(Clone, Copy)]
pub(crate) struct Avx512;

#[derive(Clone, Copy)]
pub(crate) struct Avx2;

impl Isa for Avx512 {
    #[inline(always)]
    unsafe fn dot<T: Elem>(self, q: &[f32], key: &[T], d: usize) -> f32 {
        if !d.is_multiple_of(16) {
            return dot(q, key, d);
        }
        let (q, key) = (&q[..d], &key[..d]);
        dot512(q.as_ptr(), key.as_ptr(), d)
    }
    #[inline(always)]
    unsafe fn axpy<T: Elem>(self, acc: &mut [f32], a: f32, x: &[T], d: usize) {
        if !d.is_multiple_of(16) {
            return axpy(acc, a, x, d);
        }
        let (acc, x) = (&mut acc[..d], &x[..d]);
        axpy512(acc.as_mut_ptr(), a, x.as_ptr(), d)
    }
}

impl Isa for Avx2 {
    #[inline(always)]
    unsafe fn dot<T: Elem>(self, q: &[f32], key: &[T], d: usize) -> f32 {
        if !d.is_multiple_of(8) {
            return dot(q, key, d);
        }
        let (q, key) = (&q[..d], &key[..d]);
        dot256(q.as_ptr(), key.as_ptr(), d)
    }
    #[inline(always)]
    unsafe fn axpy<T: Elem>(self, acc: &mut [f32], a: f32, x: &[T], d: usize) {
        if !d.is_multiple_of(8) {
            return axpy(acc, a, x, d);
        }
        let (acc, x) = (&mut acc[..d], &x[..d]);
        axpy256(acc.as_mut_ptr(), a, x.as_ptr(), d)
    }
}

#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load16<T: Elem>(p: *const T) -> __m512 {
    if T::IS_BF16 {
        let half = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(half)))
    } else {
        _mm512_loadu_ps(p as *const f32)
    }
}

/// SAFETY: `d` (a multiple of 16) elements readable at `q` and `k`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn dot512<T: Elem>(q: *const f32, k: *const T, d: usize) -> f32 {
    let mut acc = _mm512_setzero_ps();
    let mut c = 0;
    while c < d {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(c)), load16(k.add(c)), acc);
        c += 16;
    }
    _mm512_reduce_add_ps(acc)
}

/// SAFETY: `d` (a multiple of 16) elements at `acc` (written) and `x` (read).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn axpy512<T: Elem>(acc: *mut f32, a: f32, x: *const T, d: usize) {
    let a = _mm512_set1_ps(a);
    let mut c = 0;
    while c < d {
        let sum = _mm512_fmadd_ps(a, load16(x.add(c)), _mm512_loadu_ps(acc.add(c)));
        _mm512_storeu_ps(acc.add(c), sum);
        c += 16;
    }
}

#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn load8<T: Elem>(p: *const T) -> __m256 {
    if T::IS_BF16 {
        let half = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(half)))
    } else {
        _mm256_loadu_ps(p as *const f32)
    }
}

/// SAFETY: `d` (a multiple of 8) elements readable at `q` and `k`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn dot256<T: Elem>(q: *const f32, k: *const T, d: usize) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut c = 0;
    while c < d {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(c)), load8(k.add(c)), acc);
        c += 8;
    }
    let half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
    let pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps::<1>(pair, pair)))
}

/// SAFETY: `d` (a multiple of 8) elements at `acc` (written) and `x` (read).
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn axpy256<T: Elem>(acc: *mut f32, a: f32, x: *const T, d: usize) {
    let a = _mm256_set1_ps(a);
    let mut c = 0;
    while c < d {
        let sum = _mm256_fmadd_ps(a, load8(x.add(c)), _mm256_loadu_ps(acc.add(c)));
        _mm256_storeu_ps(acc.add(c), sum);
        c += 8;
    }
}
