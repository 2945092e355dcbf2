//! The vector primitives the kernels are written in, per instruction set: f32 lanes
//! (`F32Lanes`: 16 for AVX-512, 8 for AVX2), the group dot product of the int8 GEMV (`Dot`)
//! and the 4-level multiply-add of the int8 tiles (`IntLanes`). All `#[inline(always)]`:
//! they compile into the `#[target_feature]` function that calls them.

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
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
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
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        _mm512_mul_ps(a, b)
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
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        _mm256_mul_ps(a, b)
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

/// The GEMV's group dot product: 32 levels against 32 int8 activations into 8 lanes of 4
/// products each (lane i: values 4i .. 4i + 4).
pub(crate) trait Dot: Copy {
    /// SAFETY: the instruction set's features are available.
    unsafe fn dot(q: __m256i, x: __m256i, signed: bool) -> __m256i;
}

/// `vpdpbusd` on 256 bits (AVX-512 VNNI with VL): no intermediate saturation.
#[derive(Clone, Copy)]
pub(crate) struct Vnni;

/// `pmaddubsw` + `pmaddwd` (AVX2): pairs saturate at 16 bits, which levels up to 63 against
/// activations up to 127 never reach; signed levels (Q8_0) go as |q| and sign(x, q).
#[derive(Clone, Copy)]
pub(crate) struct Madd;

impl Dot for Vnni {
    #[inline(always)]
    unsafe fn dot(q: __m256i, x: __m256i, signed: bool) -> __m256i {
        let zero = _mm256_setzero_si256();
        if signed {
            _mm256_dpbusd_epi32(zero, _mm256_abs_epi8(q), _mm256_sign_epi8(x, q))
        } else {
            _mm256_dpbusd_epi32(zero, q, x)
        }
    }
}

impl Dot for Madd {
    #[inline(always)]
    unsafe fn dot(q: __m256i, x: __m256i, signed: bool) -> __m256i {
        let pairs = if signed {
            _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q))
        } else {
            _mm256_maddubs_epi16(q, x)
        };
        _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
    }
}

/// The int8 tiles' lanes: each i32 lane one row of W, 4 levels of it against 4 activations
/// (broadcast) per step.
pub(crate) trait IntLanes: Copy {
    type I: Copy;
    type F: F32Lanes;
    /// Rows of W per vector.
    const WIDTH: usize;
    /// Whether levels must be unsigned 0..=63 or signed (`pmaddubsw` saturates beyond).
    const NARROW: bool;
    unsafe fn splat(v: i32) -> Self::I;
    unsafe fn load(p: *const u8) -> Self::I;
    /// `acc + sum of 4 products` per lane; `x4` the 4 activations as one i32.
    unsafe fn dot4(acc: Self::I, w: Self::I, x4: i32, signed: bool) -> Self::I;
    unsafe fn to_f32(v: Self::I) -> <Self::F as F32Lanes>::V;
}

impl IntLanes for Vnni {
    type I = __m512i;
    type F = Avx512;
    const WIDTH: usize = 16;
    const NARROW: bool = false;
    #[inline(always)]
    unsafe fn splat(v: i32) -> __m512i {
        _mm512_set1_epi32(v)
    }
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m512i {
        _mm512_loadu_si512(p as *const __m512i)
    }
    #[inline(always)]
    unsafe fn dot4(acc: __m512i, w: __m512i, x4: i32, _signed: bool) -> __m512i {
        _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4))
    }
    #[inline(always)]
    unsafe fn to_f32(v: __m512i) -> __m512 {
        _mm512_cvtepi32_ps(v)
    }
}

impl IntLanes for Madd {
    type I = __m256i;
    type F = Avx2;
    const WIDTH: usize = 8;
    const NARROW: bool = true;
    #[inline(always)]
    unsafe fn splat(v: i32) -> __m256i {
        _mm256_set1_epi32(v)
    }
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256i {
        _mm256_loadu_si256(p as *const __m256i)
    }
    #[inline(always)]
    unsafe fn dot4(acc: __m256i, w: __m256i, x4: i32, signed: bool) -> __m256i {
        let x = _mm256_set1_epi32(x4);
        let pairs = if signed {
            _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
        } else {
            _mm256_maddubs_epi16(w, x)
        };
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }
    #[inline(always)]
    unsafe fn to_f32(v: __m256i) -> __m256 {
        _mm256_cvtepi32_ps(v)
    }
}
