//! The panel kernels' vectors: 16 dword lanes (one per row of a panel) of integers or f32,
//! as one AVX-512 register (`Zmm`) or two AVX2 ones (`Ymm`), with the byte dot product
//! `vpdpbusd` (AVX-512 VNNI, AVX-VNNI) or `vpmaddubsw` + `vpmaddwd` (AVX2), which saturates at
//! 16 bits: 6-bit levels times a signed byte never reach it; Q8_0's 8-bit levels go through
//! it as two nibbles (`Lanes::dot_full`).

use std::arch::x86_64::*;

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
