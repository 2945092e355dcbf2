//! The step's working buffers, kept between steps (a decode step should not allocate), and
//! its clock: where a step's time went, when asked.

use std::time::Instant;

/// The parts of a step the clock tells apart.
pub const MATMUL: usize = 0;
/// attention, with the K/V writes
pub const ATTENTION: usize = 1;
/// norms, rotary embedding, the gated activation, biases
pub const ELEMENTWISE: usize = 2;

/// Nanoseconds per part since `Scratch::profile` turned it on.
#[derive(Default)]
pub struct Clock {
    last: Option<Instant>,
    pub spent: [u64; 3],
}

impl Clock {
    pub(crate) fn start(&mut self) {
        if self.last.is_some() {
            self.last = Some(Instant::now());
        }
    }

    /// The time since the last lap goes to `part` (nothing when the clock is off).
    pub(crate) fn lap(&mut self, part: usize) {
        if let Some(last) = self.last {
            let now = Instant::now();
            self.spent[part] += (now - last).as_nanos() as u64;
            self.last = Some(now);
        }
    }
}

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
    pub(crate) clock: Clock,
}

fn grow(v: &mut Vec<f32>, len: usize) {
    if v.len() < len {
        v.resize(len, 0.0);
    }
}

impl Scratch {
    /// Time each part of the steps from now on (`on`), or stop; the totals restart at 0.
    pub fn profile(&mut self, on: bool) {
        self.clock = Clock {
            last: on.then(Instant::now),
            spent: [0; 3],
        };
    }

    /// Nanoseconds spent per part (`MATMUL`, `ATTENTION`, `ELEMENTWISE`) while profiling.
    pub fn spent(&self) -> [u64; 3] {
        self.clock.spent
    }

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
