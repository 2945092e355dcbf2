//! int8 activations for the integer kernels: each run of 32 values of a row of `x` becomes 32
//! levels in -127..=127 and one f32 scale (`x ~ scale * q`, the scale `max |x| / 127`), as
//! llama.cpp's Q8_0 activations. One portable implementation serves every instruction set,
//! so all of them see the same levels and differ only in the order of f32 additions.

/// `x` `[n, cols]` quantized per 32 values.
pub(crate) struct Acts {
    /// `[n, cols]` levels.
    pub q: Vec<i8>,
    /// `[n, cols / 32]` scales.
    pub scale: Vec<f32>,
    /// `[n, cols / 16]`: the scale of each 16 values (each of `scale` twice), for kernels
    /// that scale sub-blocks of 16 in one vector.
    pub scale16: Vec<f32>,
    /// `[n, cols / 16]`: `scale * (sum of the 16 levels)`, the factor of a weight offset.
    pub sum16: Vec<f32>,
    /// `[n, cols / 16]`: the sum of the 16 levels, for zero points folded into the integers.
    pub qsum16: Vec<i32>,
    /// `[n, cols / 32]`: the two halves' `sum16` added, the factor of a 32-weight group's
    /// offset.
    pub sum32: Vec<f32>,
    /// `q` in the order of the k-quant GEMV (`arrange_k`), or empty.
    pub qk: Vec<i8>,
}

impl Acts {
    /// `cols` is a multiple of 32 (every block format's is).
    pub fn quantize(x: &[f32], n: usize, cols: usize) -> Acts {
        #[cfg(target_arch = "x86_64")]
        let simd = crate::x86::has_avx512();
        #[cfg(not(target_arch = "x86_64"))]
        let simd = false;
        Acts::quantize_with(x, n, cols, simd)
    }

    /// `quantize`, with the AVX-512 groups or the portable loop only (the same values).
    pub(crate) fn quantize_with(x: &[f32], n: usize, cols: usize, simd: bool) -> Acts {
        debug_assert_eq!(x.len(), n * cols);
        let groups = n * cols / 32;
        let mut acts = Acts {
            q: vec![0; n * cols],
            scale: vec![0.0; groups],
            scale16: vec![0.0; 2 * groups],
            sum16: vec![0.0; 2 * groups],
            qsum16: vec![0; 2 * groups],
            sum32: vec![0.0; groups],
            qk: Vec::new(),
        };
        let _ = simd;
        for (g, src) in x.chunks_exact(32).enumerate() {
            // SAFETY: AVX-512 checked by the caller; `src` holds 32 values; g < groups.
            #[cfg(target_arch = "x86_64")]
            if simd && unsafe { quantize32_avx512(src, &mut acts, g) } {
                continue;
            }
            acts.quantize32(src, g);
        }
        acts
    }

    /// Fills `qk`: `q` with each 256-value block in 4 runs of 64, run k holding values
    /// 4k .. 4k + 4 of each of the block's 16 runs of 16 (run i at 4i), the order in which
    /// the AVX-512 GEMV lays out a Q4_K / Q5_K super-block's levels (x86::gemv_k). `cols` a
    /// multiple of 256 (the k-quants' rows are).
    pub(crate) fn arrange_k(&mut self, cols: usize) {
        if !cols.is_multiple_of(256) || !self.qk.is_empty() {
            return;
        }
        self.qk = vec![0; self.q.len()];
        for (src, dst) in self.q.chunks_exact(256).zip(self.qk.chunks_exact_mut(256)) {
            for k in 0..4 {
                for i in 0..16 {
                    dst[64 * k + 4 * i..][..4].copy_from_slice(&src[16 * i + 4 * k..][..4]);
                }
            }
        }
    }

    /// Group `g` (the 32 values `src`).
    fn quantize32(&mut self, src: &[f32], g: usize) {
        let dst = &mut self.q[32 * g..32 * g + 32];
        let amax = src.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        for (d, v) in dst.iter_mut().zip(src) {
            *d = round_small(v * inv) as i8;
        }
        self.scale[g] = scale;
        for h in 0..2 {
            let sum: i32 = dst[16 * h..16 * h + 16].iter().map(|&q| i32::from(q)).sum();
            self.qsum16[2 * g + h] = sum;
            self.scale16[2 * g + h] = scale;
            self.sum16[2 * g + h] = scale * sum as f32;
        }
        self.sum32[g] = self.sum16[2 * g] + self.sum16[2 * g + 1];
    }
}

/// One group as the portable loop computes it (the same f32 operations: `v * inv` clamped to
/// +-127, rounded to nearest even, the scale and the sums), in vectors: the portable loop cost
/// 7 us of a 4096-wide decode GEMV's 250, 24 us for 11008 columns, on one thread while the
/// other waited. Returns false, having written nothing, for a group with a NaN, an infinity or
/// a maximum below ~4e-37, whose inverse overflows (the portable loop's NaN rules hold there).
/// SAFETY: AVX-512 F and BW available; `src` holds 32 values; group `g` is in range.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantize32_avx512(src: &[f32], acts: &mut Acts, g: usize) -> bool {
    use std::arch::x86_64::*;
    let v = [
        _mm512_loadu_ps(src.as_ptr()),
        _mm512_loadu_ps(src.as_ptr().add(16)),
    ];
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v[0], v[0])
        | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v[1], v[1]);
    if nan != 0 {
        return false;
    }
    let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    let scale = amax / 127.0;
    let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    if !amax.is_finite() || !inv.is_finite() {
        return false; // infinities (inf * 0 is NaN), or a scale too small to invert
    }
    let inv = _mm512_set1_ps(inv);
    let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
    acts.scale[g] = scale;
    for (h, half) in v.into_iter().enumerate() {
        let r = _mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(half, inv), hi), lo);
        let q = _mm512_cvtps_epi32(_mm512_roundscale_ps::<_MM_FROUND_TO_NEAREST_INT>(r));
        let dst = acts.q.as_mut_ptr().add(32 * g + 16 * h);
        _mm_storeu_si128(dst as *mut __m128i, _mm512_cvtepi32_epi8(q));
        let sum = _mm512_reduce_add_epi32(q);
        acts.qsum16[2 * g + h] = sum;
        acts.scale16[2 * g + h] = scale;
        acts.sum16[2 * g + h] = scale * sum as f32;
    }
    acts.sum32[g] = acts.sum16[2 * g] + acts.sum16[2 * g + 1];
    true
}

/// `v` (|v| <= 127, or NaN) to the nearest integer, ties to even, as f32: adding and
/// subtracting 1.5 * 2^23 leaves no fraction bits (the default rounding does the rest), which
/// compiles to two vector adds where `round_ties_even` calls libm.
#[inline(always)]
fn round_small(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    ((v.clamp(-127.0, 127.0) + MAGIC) - MAGIC).clamp(-127.0, 127.0)
}
