//! Activations for the panel kernels: each row of x rounded per 32 values to integer levels
//! with one f32 scale (`x ~ scale * q`), held as the bytes the integer dot products take.
//!
//! `Precision::Int8`: levels -127..=127, the scale `max |x| / 127` (llama.cpp's Q8_0
//! activations' rounding). `Precision::Int16`: levels -16383..=16383, the
//! scale `max |x| / 16383`, 129x finer; a level `q = 128 * hi + lo` is held as two bytes,
//! `hi = q >> 7` (-128..=127) and `lo = q & 127`, so that each meets the unsigned weight
//! levels in the same byte dot product (`vpdpbusd`) and the two sums add up exactly in int32
//! (`128 * hi_sum + lo_sum`). A group with a NaN or an infinity gets a NaN scale and zero
//! levels: every output it meets is NaN, as with float activations.

/// How finely the panel kernels round the activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    Int8,
    Int16,
}

impl Precision {
    pub const ALL: [Precision; 2] = [Precision::Int8, Precision::Int16];

    pub fn name(self) -> &'static str {
        match self {
            Precision::Int8 => "int8",
            Precision::Int16 => "int16",
        }
    }

    pub fn from_name(name: &str) -> Option<Precision> {
        Precision::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The largest level.
    pub const fn max_level(self) -> f32 {
        match self {
            Precision::Int8 => 127.0,
            Precision::Int16 => 16383.0,
        }
    }
}

/// `x` `[n, cols]` rounded per 32 values (module doc).
pub(crate) struct PanelActs {
    pub precision: Precision,
    pub cols: usize,
    /// `[n, cols]`: the int8 levels, or the low 7 bits of the 15-bit ones.
    pub lo: Vec<i8>,
    /// `[n, cols]`: the high part of the 15-bit levels (empty for Int8).
    pub hi: Vec<i8>,
    /// `[n, cols / 32]`.
    pub scale: Vec<f32>,
    /// `[n, cols / 32, 2]`: the sum of each 16 levels.
    pub qsum: Vec<i32>,
    /// `[n, cols / 32]`: `scale * (sum of the group's levels)`, the factor of a free offset.
    pub xsum: Vec<f32>,
}

impl PanelActs {
    /// `cols` is a multiple of 32.
    pub fn quantize(x: &[f32], n: usize, cols: usize, precision: Precision) -> PanelActs {
        debug_assert_eq!(x.len(), n * cols);
        let groups = n * cols / 32;
        let wide = precision == Precision::Int16;
        let mut acts = PanelActs {
            precision,
            cols,
            lo: vec![0; n * cols],
            hi: if wide { vec![0; n * cols] } else { Vec::new() },
            scale: vec![0.0; groups],
            qsum: vec![0; 2 * groups],
            xsum: vec![0.0; groups],
        };
        let top = precision.max_level();
        for (g, src) in x.chunks_exact(32).enumerate() {
            let amax = src.iter().fold(0f32, |m, v| m.max(v.abs()));
            if !amax.is_finite() || src.iter().any(|v| v.is_nan()) {
                acts.scale[g] = f32::NAN;
                acts.xsum[g] = f32::NAN;
                continue;
            }
            let inv = if amax > 0.0 { top / amax } else { 0.0 };
            if !inv.is_finite() {
                // |x| below ~1e-38 (Int8) / 1e-34 (Int16): zero is within the rounding
                continue;
            }
            let mut sums = [0i32; 2];
            for (i, v) in src.iter().enumerate() {
                let q = round_level(v * inv, top) as i32;
                sums[i / 16] += q;
                if wide {
                    acts.hi[32 * g + i] = (q >> 7) as i8;
                    acts.lo[32 * g + i] = (q & 127) as i8;
                } else {
                    acts.lo[32 * g + i] = q as i8;
                }
            }
            let scale = amax / top;
            acts.scale[g] = scale;
            acts.qsum[2 * g..2 * g + 2].copy_from_slice(&sums);
            acts.xsum[g] = scale * (sums[0] + sums[1]) as f32;
        }
        acts
    }

    /// The levels of row `row`'s group `g` as one i32 each (`128 * hi + lo` for Int16).
    pub fn level(&self, row: usize, col: usize) -> i32 {
        let at = row * self.cols + col;
        match self.precision {
            Precision::Int8 => i32::from(self.lo[at]),
            Precision::Int16 => 128 * i32::from(self.hi[at]) + i32::from(self.lo[at]),
        }
    }
}

/// `v` (|v| <= top, top < 2^22) to the nearest integer, ties to even, as f32: adding and
/// subtracting 1.5 * 2^23 leaves no fraction bits (as `act::round_small`).
#[inline(always)]
fn round_level(v: f32, top: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    ((v.clamp(-top, top) + MAGIC) - MAGIC).clamp(-top, top)
}
