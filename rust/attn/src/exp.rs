//! The softmax's exp: a polynomial with a range reduction, branch-free so that it vectorizes
//! (libm's `expf` is a call per element). Relative error about 2e-7 on [-87, 0].

const LOG2E: f32 = std::f32::consts::LOG2_E;
// ln 2 split in a part exact in f32 and a remainder, for an accurate range reduction.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
// Minimax coefficients of (exp(r) - 1 - r) / r^2 on [-ln2/2, ln2/2].
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// exp(x) for x <= 0 (inputs below -87 give about 1e-38 instead of a denormal or zero).
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    // not `clamp`: that keeps NaN, and the exponent cast below needs a number
    #[allow(clippy::manual_clamp)]
    let x = x.max(-87.0).min(0.0); // NaN becomes -87
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut poly = P[0];
    for c in &P[1..] {
        poly = poly * r + c;
    }
    let y = poly * r * r + r + 1.0;
    // 2^n by building the exponent bits; n is in -126..=0 here.
    // SAFETY: n is a whole number in -126..=0, so the cast is exact; unlike `as`, it needs
    // no saturation, and so vectorizes.
    let n = unsafe { n.to_int_unchecked::<i32>() };
    let scale = f32::from_bits(((n + 127) as u32) << 23);
    y * scale
}

/// exp(x) - 1 for x <= 0, accurate near 0 too (no cancellation: for |x| < ln2/2 it is the
/// reduced polynomial itself, without the 1 + that `exp_nonpositive` adds).
#[inline(always)]
pub fn expm1_nonpositive(x: f32) -> f32 {
    #[allow(clippy::manual_clamp)]
    let x = x.max(-87.0).min(0.0);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut poly = P[0];
    for c in &P[1..] {
        poly = poly * r + c;
    }
    let small = poly * r * r + r; // exp(r) - 1
                                  // SAFETY: as in `exp_nonpositive`.
    let k = unsafe { n.to_int_unchecked::<i32>() };
    let scale = f32::from_bits(((k + 127) as u32) << 23);
    if n == 0.0 {
        small
    } else {
        (small + 1.0) * scale - 1.0
    }
}

/// `cap * tanh(s / cap)` of every score (a logit soft-cap), branch-free so that it vectorizes:
/// tanh(|y|) = -m / (2 + m) with m = exp(-2|y|) - 1.
#[inline(always)]
pub fn soft_cap(row: &mut [f32], cap: f32) {
    let inv = 1.0 / cap;
    for s in row {
        let y = *s * inv;
        let m = expm1_nonpositive(-2.0 * y.abs());
        let t = -m / (2.0 + m);
        *s = cap * if y < 0.0 { -t } else { t };
    }
}

/// Replaces `row` by `exp(row - top)` and returns the sum of the new values, where `top` is
/// the largest of `row` and `sink`; a sink (an extra logit that weighs no value) adds its
/// `exp(sink - top)` to the sum only.
#[inline(always)]
pub fn softmax_numerators(row: &mut [f32], sink: Option<f32>) -> f32 {
    const LANES: usize = 16;
    let mut maxes = [f32::NEG_INFINITY; LANES];
    let (main, tail) = row.split_at(row.len() - row.len() % LANES);
    for chunk in main.chunks_exact(LANES) {
        for j in 0..LANES {
            maxes[j] = if chunk[j] > maxes[j] {
                chunk[j]
            } else {
                maxes[j]
            };
        }
    }
    let mut max = tail
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    for m in maxes {
        max = if m > max { m } else { max };
    }
    if let Some(sink) = sink {
        max = if sink > max { sink } else { max };
    }
    let mut sums = [0f32; LANES];
    let split = main.len();
    let (main, tail) = row.split_at_mut(split);
    for chunk in main.chunks_exact_mut(LANES) {
        for j in 0..LANES {
            chunk[j] = exp_nonpositive(chunk[j] - max);
            sums[j] += chunk[j];
        }
    }
    let mut sum = 0.0;
    for x in tail.iter_mut() {
        *x = exp_nonpositive(*x - max);
        sum += *x;
    }
    let sink_weight = sink.map_or(0.0, |s| exp_nonpositive(s - max));
    sums.iter().sum::<f32>() + sum + sink_weight
}
