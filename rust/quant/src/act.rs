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
}

impl Acts {
    /// `cols` is a multiple of 32 (every block format's is).
    pub fn quantize(x: &[f32], n: usize, cols: usize) -> Acts {
        debug_assert_eq!(x.len(), n * cols);
        let groups = n * cols / 32;
        let mut acts = Acts {
            q: vec![0; n * cols],
            scale: vec![0.0; groups],
            scale16: vec![0.0; 2 * groups],
            sum16: vec![0.0; 2 * groups],
            qsum16: vec![0; 2 * groups],
        };
        for (g, (src, dst)) in x
            .chunks_exact(32)
            .zip(acts.q.chunks_exact_mut(32))
            .enumerate()
        {
            let amax = src.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = amax / 127.0;
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            for (d, v) in dst.iter_mut().zip(src) {
                *d = round_small(v * inv) as i8;
            }
            acts.scale[g] = scale;
            for h in 0..2 {
                let sum: i32 = dst[16 * h..16 * h + 16].iter().map(|&q| i32::from(q)).sum();
                acts.qsum16[2 * g + h] = sum;
                acts.scale16[2 * g + h] = scale;
                acts.sum16[2 * g + h] = scale * sum as f32;
            }
        }
        acts
    }
}

/// `v` (|v| <= 127, or NaN) to the nearest integer, ties to even, as f32: adding and
/// subtracting 1.5 * 2^23 leaves no fraction bits (the default rounding does the rest), which
/// compiles to two vector adds where `round_ties_even` calls libm.
#[inline(always)]
fn round_small(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    ((v.clamp(-127.0, 127.0) + MAGIC) - MAGIC).clamp(-127.0, 127.0)
}
