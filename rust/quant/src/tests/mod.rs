//! Unit tests: every kernel on every instruction set this CPU has, against a float64
//! reference built from the portable decoder's weights (which `format` tests hold to the
//! formats' definition).
//!
//! Tolerances are error bounds, not fudge: an f32 dot product of `k` terms, summed in any
//! order, is within `gamma_k * sum |term|` of the exact one (`gamma_k = k u / (1 - k u)`,
//! `u = 2^-24`), where a term is `(|scale * q| + |offset|) * |x|` (the kernels may add the
//! scale part and the offset part apart). The panel kernels are exact products with the
//! activations rounded per 32 values (`panel_act`), so they meet that bound against the
//! float64 product with the rounded activations (tests/panel.rs), and the float64 product
//! with the true ones within `sum |w| * |x - x_rounded|` more.

mod format;
mod kernels;
mod panel;

use crate::format::{decode_block, Group, QType};

pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// A random normal f16 of magnitude 2^-10 .. 2^-1 (sometimes 0 or subnormal), as bits.
fn random_half(rng: &mut Rng) -> u16 {
    let sign = (rng.below(2) as u16) << 15;
    let man = rng.below(1024) as u16;
    match rng.below(16) {
        0 => sign,
        1 => sign | man, // subnormal
        _ => sign | ((5 + rng.below(10) as u16) << 10) | man,
    }
}

/// The byte offsets of a block's f16 fields.
fn half_fields(qtype: QType) -> &'static [usize] {
    match qtype {
        QType::Q8_0 | QType::Q4_0 | QType::Q5_0 => &[0],
        QType::Q4_1 | QType::Q5_1 | QType::Q4K | QType::Q5K => &[0, 2],
        QType::Q6K => &[208],
    }
}

/// `rows` random rows of `cols` weights: random bytes, with random finite f16 scales.
pub(crate) fn random_weights(qtype: QType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let mut data: Vec<u8> = (0..rows * qtype.row_bytes(cols))
        .map(|_| rng.next() as u8)
        .collect();
    for block in data.chunks_exact_mut(qtype.block_bytes()) {
        for &at in half_fields(qtype) {
            block[at..at + 2].copy_from_slice(&random_half(rng).to_le_bytes());
        }
    }
    data
}

/// The portable decoder's groups of one row.
pub(crate) fn row_groups(qtype: QType, row: &[u8], cols: usize) -> Vec<Group> {
    let per_block = qtype.block_len() / 32;
    let mut groups = vec![Group::default(); cols / 32];
    for (b, out) in groups.chunks_exact_mut(per_block).enumerate() {
        decode_block(qtype, &row[b * qtype.block_bytes()..], out);
    }
    groups
}

/// The float64 reference: `exact[r][o]`, the exact product; `bound[r][o]`, the f32 error
/// bound of the module doc.
pub(crate) struct Reference {
    pub exact: Vec<f64>,
    pub bound: Vec<f64>,
}

pub(crate) fn reference(
    qtype: QType,
    data: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
) -> Reference {
    let signed = qtype.is_signed();
    let row_bytes = qtype.row_bytes(cols);
    let k = cols as f64;
    let u = f64::from(f32::EPSILON) / 2.0;
    let gamma = k * u / (1.0 - k * u);
    let mut out = Reference {
        exact: vec![0.0; n * rows],
        bound: vec![0.0; n * rows],
    };
    for o in 0..rows {
        let groups = row_groups(qtype, &data[o * row_bytes..][..row_bytes], cols);
        for r in 0..n {
            let (mut exact, mut magnitude) = (0f64, 0f64);
            for (g, group) in groups.iter().enumerate() {
                for i in 0..32 {
                    let c = 32 * g + i;
                    let xv = f64::from(x[r * cols + c]);
                    let q = if signed {
                        f64::from(group.q[i] as i8)
                    } else {
                        f64::from(group.q[i])
                    };
                    let (s, m) = (
                        f64::from(group.scale[i / 16]),
                        f64::from(group.offset[i / 16]),
                    );
                    exact += f64::from(group.weight(i, signed)) * xv;
                    magnitude += ((s * q).abs() + m.abs()) * xv.abs();
                }
            }
            out.exact[r * rows + o] = exact;
            // Products and their conversions round too: a few u on top of gamma.
            out.bound[r * rows + o] = (gamma + 4.0 * u) * magnitude + f64::from(f32::MIN_POSITIVE);
        }
    }
    out
}

/// `x` `[n, cols]` random in [-1, 1), with some rows scaled and some runs zero.
pub(crate) fn random_x(n: usize, cols: usize, rng: &mut Rng) -> Vec<f32> {
    let mut x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
    for (r, row) in x.chunks_exact_mut(cols).enumerate() {
        let scale = [1.0, 30.0, 0.01][r % 3];
        row.iter_mut().for_each(|v| *v *= scale);
        if r % 4 == 3 {
            row[..32].fill(0.0);
        }
    }
    x
}
