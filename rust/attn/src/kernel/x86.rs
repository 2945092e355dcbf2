//! AVX-512 and AVX2 forms of the kernel's dot product and value accumulation (the compiler
//! turns the portable loops into 2-lane pieces). bfloat16 and fp8 are widened to f32 on load.

use std::arch::x86_64::*;

use super::isa::{axpy, dot, scores_by_dot, weighted_sum_by_axpy, Isa};
use crate::{Kind, KvElem};

#[derive(Clone, Copy)]
pub(crate) struct Avx512;

#[derive(Clone, Copy)]
pub(crate) struct Avx2;

impl Isa for Avx512 {
    #[inline(always)]
    unsafe fn dot<T: KvElem>(self, q: &[f32], key: &[T], d: usize) -> f32 {
        if !d.is_multiple_of(16) {
            return dot(q, key, d);
        }
        let (q, key) = (&q[..d], &key[..d]);
        dot512(q.as_ptr(), key.as_ptr(), d)
    }
    #[inline(always)]
    unsafe fn axpy<T: KvElem>(self, acc: &mut [f32], a: f32, x: &[T], d: usize) {
        if !d.is_multiple_of(16) {
            return axpy(acc, a, x, d);
        }
        let (acc, x) = (&mut acc[..d], &x[..d]);
        axpy512(acc.as_mut_ptr(), a, x.as_ptr(), d)
    }
    #[inline(always)]
    fn raw_scale<T: KvElem>(self) -> f32 {
        if T::KIND == Kind::E4m3 {
            E4M3_RAW_SCALE
        } else {
            1.0
        }
    }
    #[inline(always)]
    unsafe fn scores<T: KvElem>(self, q: &[f32], keys: &[*const T], out: &mut [f32], d: usize) {
        let whole = keys.len() == 16 && d.is_multiple_of(16) && out.len() >= 16;
        if T::KIND == Kind::E4m3 {
            // q comes scaled by E4M3_RAW_SCALE (`raw_scale`): the raw loads' scores are
            // exact; a block holding a NaN byte, or a partial one, takes the exact loads
            if whole && !any_e4m3_nan(keys, d) {
                return scores16::<T, true>(q[..d].as_ptr(), keys, out.as_mut_ptr(), d);
            }
            scores_by_dot(self, q, keys, out, d);
            for o in &mut out[..keys.len()] {
                *o *= 1.0 / E4M3_RAW_SCALE;
            }
            return;
        }
        if !whole {
            return scores_by_dot(self, q, keys, out, d);
        }
        scores16::<T, false>(q[..d].as_ptr(), keys, out.as_mut_ptr(), d)
    }
    #[inline(always)]
    unsafe fn weighted_sum<T: KvElem>(
        self,
        acc: &mut [f32],
        weights: &[f32],
        values: &[*const T],
        d: usize,
    ) {
        let n = weights.len().min(values.len());
        if T::KIND == Kind::E4m3 {
            // the sum comes out divided by E4M3_RAW_SCALE (`raw_scale`)
            if d.is_multiple_of(16) && !any_e4m3_nan(&values[..n], d) {
                return weighted_sum512::<T, true>(
                    acc[..d].as_mut_ptr(),
                    &weights[..n],
                    &values[..n],
                    d,
                );
            }
            let mut scaled = [0f32; 16];
            for (ws, vs) in weights[..n].chunks(16).zip(values[..n].chunks(16)) {
                for (s, &w) in scaled.iter_mut().zip(ws) {
                    *s = w * (1.0 / E4M3_RAW_SCALE);
                }
                weighted_sum_by_axpy(self, acc, &scaled[..ws.len()], vs, d);
            }
            return;
        }
        if !d.is_multiple_of(16) {
            return weighted_sum_by_axpy(self, acc, weights, values, d);
        }
        weighted_sum512::<T, false>(acc[..d].as_mut_ptr(), &weights[..n], &values[..n], d)
    }
}

impl Isa for Avx2 {
    #[inline(always)]
    unsafe fn dot<T: KvElem>(self, q: &[f32], key: &[T], d: usize) -> f32 {
        if !d.is_multiple_of(8) {
            return dot(q, key, d);
        }
        let (q, key) = (&q[..d], &key[..d]);
        dot256(q.as_ptr(), key.as_ptr(), d)
    }
    #[inline(always)]
    unsafe fn axpy<T: KvElem>(self, acc: &mut [f32], a: f32, x: &[T], d: usize) {
        if !d.is_multiple_of(8) {
            return axpy(acc, a, x, d);
        }
        let (acc, x) = (&mut acc[..d], &x[..d]);
        axpy256(acc.as_mut_ptr(), a, x.as_ptr(), d)
    }
}

/// Sixteen elements at `p` as f32. fp8 widens through f16 (exact): e5m2 is an f16's top
/// byte; e4m3's sign and 7 other bits placed in an f16 give its value / 256 (subnormals
/// included), and its one NaN pattern is set apart.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn load16<T: KvElem>(p: *const T) -> __m512 {
    match T::KIND {
        Kind::F32 => _mm512_loadu_ps(p as *const f32),
        Kind::Bf16 => {
            let half = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(half)))
        }
        Kind::E5m2 | Kind::E4m3 => {
            let bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
            if T::KIND == Kind::E5m2 {
                return _mm512_cvtph_ps(_mm256_slli_epi16::<8>(bytes));
            }
            let rest = _mm256_and_si256(bytes, _mm256_set1_epi16(0x7f));
            let sign = _mm256_slli_epi16::<8>(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)));
            let half = _mm256_or_si256(sign, _mm256_slli_epi16::<7>(rest));
            let nan = _mm256_cmpeq_epi16(rest, _mm256_set1_epi16(0x7f));
            let half = _mm256_blendv_epi8(half, _mm256_set1_epi16(0x7e00), nan);
            _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0))
        }
    }
}

/// What the raw e4m3 loads (`load16_raw`) understate values by: 2^8.
pub(crate) const E4M3_RAW_SCALE: f32 = 256.0;

/// Sixteen elements at `p` as f32, e4m3 as its value / `E4M3_RAW_SCALE` (exact): the byte
/// sign-extended to 16 bits and shifted puts sign, exponent and mantissa where an f16 has
/// them (less the bit that sign extension also set), and f16 has the range for every e4m3
/// value over 2^8, subnormals included. Three integer operations where `load16` takes
/// nine, which was most of a decode step's attention on an fp8 pool. The NaN pattern reads
/// as 480 / 2^8: callers check for it first (`any_e4m3_nan`). Other kinds: `load16`.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn load16_raw<T: KvElem>(p: *const T) -> __m512 {
    if T::KIND != Kind::E4m3 {
        return load16(p);
    }
    let words = _mm256_cvtepi8_epi16(_mm_loadu_si128(p as *const __m128i));
    let half = _mm256_and_si256(_mm256_slli_epi16::<7>(words), _mm256_set1_epi16(-0x4001));
    _mm512_cvtph_ps(half)
}

/// Whether any of the `d` bytes (a multiple of 16) at any row is an e4m3 NaN (S.1111.111).
/// SAFETY: `d` bytes readable at every row; the CPU has AVX-512BW.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(crate) unsafe fn any_e4m3_nan<T>(rows: &[*const T], d: usize) -> bool {
    // the bytes' low 7 bits, their running maximum: 0x7f somewhere iff a NaN
    let (low, low16) = (_mm512_set1_epi8(0x7f), _mm_set1_epi8(0x7f));
    let (mut top, mut top16) = (_mm512_setzero_si512(), _mm_setzero_si128());
    for &row in rows {
        let row = row as *const u8;
        let mut c = 0;
        while c + 64 <= d {
            let v = _mm512_loadu_si512(row.add(c) as *const _);
            top = _mm512_max_epu8(top, _mm512_and_si512(v, low));
            c += 64;
        }
        while c < d {
            let v = _mm_loadu_si128(row.add(c) as *const __m128i);
            top16 = _mm_max_epu8(top16, _mm_and_si128(v, low16));
            c += 16;
        }
    }
    _mm512_cmpeq_epi8_mask(top, low) != 0 || _mm_movemask_epi8(_mm_cmpeq_epi8(top16, low16)) != 0
}

/// SAFETY: `d` (a multiple of 16) elements readable at `q` and `k`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn dot512<T: KvElem>(q: *const f32, k: *const T, d: usize) -> f32 {
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
unsafe fn axpy512<T: KvElem>(acc: *mut f32, a: f32, x: *const T, d: usize) {
    let a = _mm512_set1_ps(a);
    let mut c = 0;
    while c < d {
        let sum = _mm512_fmadd_ps(a, load16(x.add(c)), _mm512_loadu_ps(acc.add(c)));
        _mm512_storeu_ps(acc.add(c), sum);
        c += 16;
    }
}

/// Eight elements at `p` as f32 (fp8 as in `load16`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn load8<T: KvElem>(p: *const T) -> __m256 {
    match T::KIND {
        Kind::F32 => _mm256_loadu_ps(p as *const f32),
        Kind::Bf16 => {
            let half = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(half)))
        }
        Kind::E5m2 | Kind::E4m3 => {
            let bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(p as *const __m128i));
            if T::KIND == Kind::E5m2 {
                return _mm256_cvtph_ps(_mm_slli_epi16::<8>(bytes));
            }
            let rest = _mm_and_si128(bytes, _mm_set1_epi16(0x7f));
            let sign = _mm_slli_epi16::<8>(_mm_and_si128(bytes, _mm_set1_epi16(0x80)));
            let half = _mm_or_si128(sign, _mm_slli_epi16::<7>(rest));
            let nan = _mm_cmpeq_epi16(rest, _mm_set1_epi16(0x7f));
            let half = _mm_blendv_epi8(half, _mm_set1_epi16(0x7e00), nan);
            _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0))
        }
    }
}

/// SAFETY: `d` (a multiple of 8) elements readable at `q` and `k`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot256<T: KvElem>(q: *const f32, k: *const T, d: usize) -> f32 {
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
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn axpy256<T: KvElem>(acc: *mut f32, a: f32, x: *const T, d: usize) {
    let a = _mm256_set1_ps(a);
    let mut c = 0;
    while c < d {
        let sum = _mm256_fmadd_ps(a, load8(x.add(c)), _mm256_loadu_ps(acc.add(c)));
        _mm256_storeu_ps(acc.add(c), sum);
        c += 8;
    }
}

/// Sixteen dot products of `q` with sixteen key rows (`RAW`: through `load16_raw`): sixteen
/// vector accumulators, then one transposing reduction (lane i of the result is the sum of
/// accumulator i) instead of a horizontal sum per key.
/// SAFETY: `d` (a multiple of 16) elements at `q` and at every key; 16 writable at `out`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn scores16<T: KvElem, const RAW: bool>(
    q: *const f32,
    keys: &[*const T],
    out: *mut f32,
    d: usize,
) {
    // key by key, each row read start to end, over a block of a fixed 16: its accumulators
    // stay in registers (over a slice of keys they went to the stack and back every key;
    // with the raw loads, one thread's fp8 step at 160 keys 128 -> 96 us)
    let keys: &[*const T; 16] = keys.try_into().expect("a block of 16 keys");
    let mut acc = [_mm512_setzero_ps(); 16];
    for i in 0..16 {
        let (a, key) = (&mut acc[i], keys[i]);
        let mut c = 0;
        while c < d {
            let k = if RAW {
                load16_raw(key.add(c))
            } else {
                load16(key.add(c))
            };
            *a = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(c)), k, *a);
            c += 16;
        }
    }
    _mm512_storeu_ps(out, transpose_sum16(acc));
}

/// `[v0, .., v15] -> r` with `r[i] = sum of the lanes of v_i`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn transpose_sum16(v: [__m512; 16]) -> __m512 {
    // pairs: per 128-bit lane, [a0+a2, b0+b2, a1+a3, b1+b3]
    let mut pairs = [_mm512_setzero_ps(); 8];
    for (i, p) in pairs.iter_mut().enumerate() {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        *p = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    // quads: per 128-bit lane, that lane's sums of v_{4i}, v_{4i+1}, v_{4i+2}, v_{4i+3}
    let mut quads = [_mm512_setzero_ps(); 4];
    for (i, q) in quads.iter_mut().enumerate() {
        let (a, b) = (
            _mm512_castps_pd(pairs[2 * i]),
            _mm512_castps_pd(pairs[2 * i + 1]),
        );
        let lo = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        let hi = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        *q = _mm512_add_ps(lo, hi);
    }
    // add the four 128-bit lanes of each quad: lane pairs, then pairs of pairs
    let fold = |a: __m512, b: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        )
    };
    fold(fold(quads[0], quads[1]), fold(quads[2], quads[3]))
}

/// `acc += sum_t weights[t] * values[t]`, the accumulator held in registers over the block
/// (`RAW`: the values through `load16_raw`).
/// SAFETY: `d` (a multiple of 16) elements at `acc` and at every value row.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn weighted_sum512<T: KvElem, const RAW: bool>(
    acc: *mut f32,
    weights: &[f32],
    values: &[*const T],
    d: usize,
) {
    // 128-wide chunks (eight accumulators): each value row in one pass for the usual head
    // sizes
    let mut c = 0;
    while c + 128 <= d {
        let mut a = [_mm512_setzero_ps(); 8];
        for (k, a) in a.iter_mut().enumerate() {
            *a = _mm512_loadu_ps(acc.add(c + 16 * k));
        }
        for (&w, &value) in weights.iter().zip(values) {
            let w = _mm512_set1_ps(w);
            for (k, a) in a.iter_mut().enumerate() {
                let at = value.add(c + 16 * k);
                let v = if RAW { load16_raw(at) } else { load16(at) };
                *a = _mm512_fmadd_ps(w, v, *a);
            }
        }
        for (k, a) in a.iter().enumerate() {
            _mm512_storeu_ps(acc.add(c + 16 * k), *a);
        }
        c += 128;
    }
    while c + 64 <= d {
        let mut a = [
            _mm512_loadu_ps(acc.add(c)),
            _mm512_loadu_ps(acc.add(c + 16)),
            _mm512_loadu_ps(acc.add(c + 32)),
            _mm512_loadu_ps(acc.add(c + 48)),
        ];
        for (&w, &value) in weights.iter().zip(values) {
            let w = _mm512_set1_ps(w);
            for (k, a) in a.iter_mut().enumerate() {
                let at = value.add(c + 16 * k);
                let v = if RAW { load16_raw(at) } else { load16(at) };
                *a = _mm512_fmadd_ps(w, v, *a);
            }
        }
        for (k, a) in a.iter().enumerate() {
            _mm512_storeu_ps(acc.add(c + 16 * k), *a);
        }
        c += 64;
    }
    while c < d {
        let mut a = _mm512_loadu_ps(acc.add(c));
        for (&w, &value) in weights.iter().zip(values) {
            let v = if RAW {
                load16_raw(value.add(c))
            } else {
                load16(value.add(c))
            };
            a = _mm512_fmadd_ps(_mm512_set1_ps(w), v, a);
        }
        _mm512_storeu_ps(acc.add(c), a);
        c += 16;
    }
}
