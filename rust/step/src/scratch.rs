//! The step's working buffers, kept between steps (a decode step should not allocate).

/// Buffers of `decode_step`, grown to the largest step seen.
#[derive(Default)]
pub struct Scratch {
    pub(crate) residual: Vec<f32>,
    pub(crate) normed: Vec<f32>,
    pub(crate) qkv: Vec<f32>,
    pub(crate) q_normed: Vec<f32>,
    pub(crate) k_normed: Vec<f32>,
    pub(crate) q_rot: Vec<f32>,
    pub(crate) k_rot: Vec<f32>,
    pub(crate) attn: Vec<f32>,
    pub(crate) branch: Vec<f32>,
    pub(crate) gate_up: Vec<f32>,
    pub(crate) act: Vec<f32>,
    pub(crate) tmp: Vec<f32>,
}

fn grow(v: &mut Vec<f32>, len: usize) {
    if v.len() < len {
        v.resize(len, 0.0);
    }
}

impl Scratch {
    /// Room for `n` rows of a model of these widths.
    pub(crate) fn size(&mut self, n: usize, hidden: usize, qkv: usize, q: usize, inter: usize) {
        let kv = (qkv - q) / 2;
        grow(&mut self.residual, n * hidden);
        grow(&mut self.normed, n * hidden);
        grow(&mut self.qkv, n * qkv);
        grow(&mut self.q_normed, n * q);
        grow(&mut self.k_normed, n * kv);
        grow(&mut self.q_rot, n * q);
        grow(&mut self.k_rot, n * kv);
        grow(&mut self.attn, n * q);
        grow(&mut self.branch, n * hidden);
        grow(&mut self.gate_up, n * 2 * inter);
        grow(&mut self.act, n * inter);
    }
}
