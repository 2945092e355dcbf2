//! AVX2 decoders: one block of a format into its groups, 32 levels in one 256-bit register
//! with the group's scales and offsets (`format::Group`'s form, same values). The AVX-512
//! kernels use them too: a block's bytes are narrower than any register either way.

use std::arch::x86_64::*;

use crate::format::QType;

/// A block format as the SIMD kernels see it.
pub(crate) trait Fmt {
    const QTYPE: QType;
    const LEN: usize = Self::QTYPE.block_len();
    const BYTES: usize = Self::QTYPE.block_bytes();
    const SIGNED: bool = Self::QTYPE.is_signed();

    /// `f(group, levels, scale, offset)` for each group of the block at `b`, in order.
    /// SAFETY: the CPU has AVX2, FMA and F16C; `BYTES` bytes are readable at `b`.
    unsafe fn decode(b: *const u8, f: impl FnMut(usize, __m256i, [f32; 2], [f32; 2]));
}

#[inline(always)]
pub(crate) unsafe fn half(p: *const u8) -> f32 {
    let h = (p as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
}

#[inline(always)]
unsafe fn load32(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// 16 bytes of nibbles to 32 levels: the low nibbles, then the high ones.
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> __m256i {
    let raw = _mm_loadu_si128(p as *const __m128i);
    let low = _mm_set1_epi8(0x0f);
    _mm256_set_m128i(
        _mm_and_si128(_mm_srli_epi16::<4>(raw), low),
        _mm_and_si128(raw, low),
    )
}

/// The little-endian u32 at `p` as 32 bytes, 0x10 where its bit is set (the fifth bit).
#[inline(always)]
unsafe fn fifth_bits(p: *const u8) -> __m256i {
    let qh = (p as *const u32).read_unaligned();
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(qh as i32),
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

pub(crate) struct Q8_0;
pub(crate) struct Q4_0;
pub(crate) struct Q4_1;
pub(crate) struct Q5_0;
pub(crate) struct Q5_1;
pub(crate) struct Q4K;
pub(crate) struct Q5K;
pub(crate) struct Q6K;

impl Fmt for Q8_0 {
    const QTYPE: QType = QType::Q8_0;
    #[inline(always)]
    unsafe fn decode(b: *const u8, mut f: impl FnMut(usize, __m256i, [f32; 2], [f32; 2])) {
        let d = half(b);
        f(0, load32(b.add(2)), [d; 2], [0.0; 2]);
    }
}

impl Fmt for Q4_0 {
    const QTYPE: QType = QType::Q4_0;
    #[inline(always)]
    unsafe fn decode(b: *const u8, mut f: impl FnMut(usize, __m256i, [f32; 2], [f32; 2])) {
        let d = half(b);
        f(0, nibbles(b.add(2)), [d; 2], [-8.0 * d; 2]);
    }
}

impl Fmt for Q4_1 {
    const QTYPE: QType = QType::Q4_1;
    #[inline(always)]
    unsafe fn decode(b: *const u8, mut f: impl FnMut(usize, __m256i, [f32; 2], [f32; 2])) {
        f(0, nibbles(b.add(4)), [half(b); 2], [half(b.add(2)); 2]);
    }
}

impl Fmt for Q5_0 {
    const QTYPE: QType = QType::Q5_0;
    #[inline(always)]
    unsafe fn decode(b: *const u8, mut f: impl FnMut(usize, __m256i, [f32; 2], [f32; 2])) {
        let d = half(b);
        let q = _mm256_or_si256(nibbles(b.add(6)), fifth_bits(b.add(2)));
        f(0, q, [d; 2], [-16.0 * d; 2]);
    }
}

impl Fmt for Q5_1 {
    const QTYPE: QType = QType::Q5_1;
    #[inline(always)]
    unsafe fn decode(b: *const u8, mut f: impl FnMut(usize, __m256i, [f32; 2], [f32; 2])) {
        let q = _mm256_or_si256(nibbles(b.add(8)), fifth_bits(b.add(4)));
        f(0, q, [half(b); 2], [half(b.add(2)); 2]);
    }
}

/// Q4_K / Q5_K: the 8 scales `d * sc` and offsets `-dmin * mn` of a super-block, all at once
/// (the 6-bit fields of `format::k4_scale_min` as 4 bytes per u32 word).
#[inline(always)]
unsafe fn k4_scales(b: *const u8) -> ([f32; 8], [f32; 8]) {
    let (scales, mins) = k4_scale_vectors(b);
    let mut out = ([0f32; 8], [0f32; 8]);
    _mm256_storeu_ps(out.0.as_mut_ptr(), scales);
    _mm256_storeu_ps(out.1.as_mut_ptr(), mins);
    out
}

/// `k4_scales` as two vectors.
#[inline(always)]
pub(crate) unsafe fn k4_scale_vectors(b: *const u8) -> (__m256, __m256) {
    let word = |i: usize| (b.add(4 + 4 * i) as *const u32).read_unaligned();
    let (w0, w1, w2) = (word(0), word(1), word(2));
    let six = 0x3f3f_3f3f;
    let sc = [w0 & six, (w2 & 0x0f0f_0f0f) | ((w0 >> 2) & 0x3030_3030)];
    let mn = [
        w1 & six,
        ((w2 >> 4) & 0x0f0f_0f0f) | ((w1 >> 2) & 0x3030_3030),
    ];
    let widen = |lo: u32, hi: u32| {
        let bytes = _mm_cvtsi64_si128((u64::from(hi) << 32 | u64::from(lo)) as i64);
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes))
    };
    let d = _mm256_set1_ps(half(b));
    let dmin = _mm256_set1_ps(-half(b.add(2)));
    (
        _mm256_mul_ps(widen(sc[0], sc[1]), d),
        _mm256_mul_ps(widen(mn[0], mn[1]), dmin),
    )
}

/// Q4_K and Q5_K: 8 groups of 32 under one f16 scale and min, 6-bit scales and mins each;
/// with `FIFTH`, the fifth bits of group j are bit j of the 32 bytes at offset 16.
#[inline(always)]
unsafe fn decode_k4<const FIFTH: bool>(
    b: *const u8,
    mut f: impl FnMut(usize, __m256i, [f32; 2], [f32; 2]),
) {
    let (scales, mins) = k4_scales(b);
    let low = _mm256_set1_epi8(0x0f);
    let qh = if FIFTH {
        load32(b.add(16))
    } else {
        _mm256_setzero_si256()
    };
    let qs = b.add(if FIFTH { 48 } else { 16 });
    for c in 0..4 {
        let raw = load32(qs.add(32 * c));
        for h in 0..2 {
            let j = 2 * c + h;
            let mut q = if h == 0 {
                _mm256_and_si256(raw, low)
            } else {
                _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low)
            };
            if FIFTH {
                let bit = _mm256_set1_epi8(1 << j);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
            }
            f(j, q, [scales[j]; 2], [mins[j]; 2]);
        }
    }
}

impl Fmt for Q4K {
    const QTYPE: QType = QType::Q4K;
    #[inline(always)]
    unsafe fn decode(b: *const u8, f: impl FnMut(usize, __m256i, [f32; 2], [f32; 2])) {
        decode_k4::<false>(b, f)
    }
}

impl Fmt for Q5K {
    const QTYPE: QType = QType::Q5K;
    #[inline(always)]
    unsafe fn decode(b: *const u8, f: impl FnMut(usize, __m256i, [f32; 2], [f32; 2])) {
        decode_k4::<true>(b, f)
    }
}

impl Fmt for Q6K {
    const QTYPE: QType = QType::Q6K;
    #[inline(always)]
    unsafe fn decode(b: *const u8, mut f: impl FnMut(usize, __m256i, [f32; 2], [f32; 2])) {
        let d = half(b.add(208));
        let scales = b.add(192) as *const i8;
        let (low, two) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(3));
        for h in 0..2 {
            let qh = load32(b.add(128 + 32 * h));
            let ql = [load32(b.add(64 * h)), load32(b.add(64 * h + 32))];
            for s in 0..4 {
                let raw = ql[s % 2];
                let nib = if s < 2 {
                    _mm256_and_si256(raw, low)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low)
                };
                let shift = _mm_cvtsi32_si128(2 * s as i32);
                let top = _mm256_and_si256(_mm256_srl_epi16(qh, shift), two);
                let q = _mm256_or_si256(nib, _mm256_slli_epi16::<4>(top));
                let g = 4 * h + s;
                let scale = [
                    d * f32::from(*scales.add(2 * g)),
                    d * f32::from(*scales.add(2 * g + 1)),
                ];
                f(g, q, scale, [-32.0 * scale[0], -32.0 * scale[1]]);
            }
        }
    }
}

/// Calls `$body` with `$F` the `Fmt` of `$qtype`.
macro_rules! with_fmt {
    ($qtype:expr, $F:ident => $body:expr) => {{
        use $crate::format::QType as T;
        use $crate::x86::decode as d;
        match $qtype {
            T::Q8_0 => {
                type $F = d::Q8_0;
                $body
            }
            T::Q4_0 => {
                type $F = d::Q4_0;
                $body
            }
            T::Q4_1 => {
                type $F = d::Q4_1;
                $body
            }
            T::Q5_0 => {
                type $F = d::Q5_0;
                $body
            }
            T::Q5_1 => {
                type $F = d::Q5_1;
                $body
            }
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
        }
    }};
}
pub(crate) use with_fmt;

/// The 32 levels as four 8-lane f32 vectors (signed bytes for a signed format).
#[inline(always)]
pub(crate) unsafe fn levels8(q: __m256i, signed: bool) -> [__m256; 4] {
    let (lo, hi) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
    let parts = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
    parts.map(|p| {
        _mm256_cvtepi32_ps(if signed {
            _mm256_cvtepi8_epi32(p)
        } else {
            _mm256_cvtepu8_epi32(p)
        })
    })
}

/// Row `r` of `w` in f32 (`scale * q + offset` in one fused rounding: the exact value
/// rounded once). SAFETY: AVX2, FMA, F16C; `out` holds `w.cols` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dequantize_row<F: Fmt>(w: &crate::Weights<'_>, r: usize, out: &mut [f32]) {
    let row = w.row(r).as_ptr();
    let dst = out.as_mut_ptr();
    for b in 0..w.num_blocks() {
        F::decode(
            row.add(b * F::BYTES),
            #[inline(always)]
            |g, q, s, m| {
                let at = dst.add(b * F::LEN + 32 * g);
                for (j, v) in levels8(q, F::SIGNED).into_iter().enumerate() {
                    let h = j / 2;
                    let v = _mm256_fmadd_ps(v, _mm256_set1_ps(s[h]), _mm256_set1_ps(m[h]));
                    _mm256_storeu_ps(at.add(8 * j), v);
                }
            },
        );
    }
}
