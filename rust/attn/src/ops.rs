//! The decoder layer's element-wise steps on the CPU, each one pass over memory: the residual
//! add fused with RMSNorm, act(gate) * up (SiLU or the tanh GELU), and the rotary embedding
//! of q and k.
//!
//! torch runs each of these as three to six ops (and as many passes and temporaries); on a
//! decode step their dispatch, not their arithmetic, is what costs (about 9 ms of a 100 ms
//! step at 16 rows, 30 layers). Math is in f32; bfloat16 results are rounded where torch
//! rounds them (after the add, after the normalisation, after SiLU), so the two paths agree
//! to the last bit in most elements and within one bf16 ulp elsewhere.
//!
//! Rows are split over threads (`pool`) only when there are enough of them to pay for it.

use crate::exp::exp_nonpositive;
use crate::{err, pool, AttnError, Elem};

pub use crate::rope::{rope, HeadRows};

/// Below this many elements a second thread costs more than it saves.
const MIN_PARALLEL_ELEMS: usize = 1 << 16;

/// A pointer that may cross to the threads of `pool::for_each`; each thread writes rows no
/// other touches.
#[derive(Clone, Copy)]
pub(crate) struct Shared<T>(pub(crate) *mut T);
// SAFETY: used only to write disjoint row ranges (see `for_rows`).
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}

impl<T> Shared<T> {
    /// SAFETY: `at + len` is inside the buffer and no other thread uses these elements.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn rows(&self, at: usize, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }
}

/// The work on a range of rows; `run` is inlined into `run_best`'s per-ISA copies.
pub(crate) trait RowJob: Sync {
    /// SAFETY: the ranges given to concurrent calls are disjoint.
    unsafe fn run(&self, from: usize, to: usize);
}

/// `job` over `rows` rows of `width` elements, in ranges over threads.
pub(crate) fn for_rows<J: RowJob>(rows: usize, width: usize, threads: usize, job: &J) {
    let threads = if rows * width < MIN_PARALLEL_ELEMS {
        1
    } else {
        threads.max(1).min(rows)
    };
    let per = rows.div_ceil(threads.max(1)).max(1);
    pool::for_each(rows.div_ceil(per), threads, &|c| {
        // SAFETY: each chunk index comes once, so the ranges are disjoint.
        unsafe { run_best(job, c * per, ((c + 1) * per).min(rows)) }
    });
}

/// SAFETY: as `RowJob::run`.
unsafe fn run_best<J: RowJob>(job: &J, from: usize, to: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::isa_cap::avx512() && std::arch::is_x86_feature_detected!("avx512f") {
            return run_avx512(job, from, to);
        }
        if crate::isa_cap::avx2()
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            return run_avx2(job, from, to);
        }
    }
    job.run(from, to)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn run_avx512<J: RowJob>(job: &J, from: usize, to: usize) {
    job.run(from, to)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2<J: RowJob>(job: &J, from: usize, to: usize) {
    job.run(from, to)
}

#[inline(always)]
fn round<T: Elem>(x: f32) -> f32 {
    if T::IS_BF16 {
        T::from_f32(x).to_f32()
    } else {
        x
    }
}

/// RMSNorm of each row of `dim` elements: `out = x / sqrt(mean(x^2) + eps) * weight`. With
/// `residual`, first `residual += x` (in place) and the sum is normalised instead.
pub fn rms_norm<T: Elem>(
    x: &[T],
    residual: Option<&mut [T]>,
    weight: &[T],
    out: &mut [T],
    eps: f32,
    threads: usize,
) -> Result<(), AttnError> {
    let dim = weight.len();
    if dim == 0 || !x.len().is_multiple_of(dim) || out.len() != x.len() {
        return err(format!(
            "rms_norm: x has {} and out {} elements, not rows of the weight's {dim}",
            x.len(),
            out.len()
        ));
    }
    if let Some(r) = &residual {
        if r.len() != x.len() {
            return err(format!(
                "rms_norm: residual has {} elements, x {}",
                r.len(),
                x.len()
            ));
        }
    }
    let job = NormJob {
        x,
        residual: residual.map(|r| Shared(r.as_mut_ptr())),
        weight,
        out: Shared(out.as_mut_ptr()),
        eps,
    };
    for_rows(x.len() / dim, dim, threads, &job);
    Ok(())
}

struct NormJob<'a, T> {
    x: &'a [T],
    residual: Option<Shared<T>>,
    weight: &'a [T],
    out: Shared<T>,
    eps: f32,
}

impl<T: Elem> RowJob for NormJob<'_, T> {
    #[inline(always)]
    unsafe fn run(&self, from: usize, to: usize) {
        let dim = self.weight.len();
        for row in from..to {
            let x = &self.x[row * dim..][..dim];
            let out = self.out.rows(row * dim, dim);
            let src: &[T] = match &self.residual {
                Some(r) => {
                    let r = r.rows(row * dim, dim);
                    for (r, &x) in r.iter_mut().zip(x) {
                        *r = T::from_f32(r.to_f32() + x.to_f32());
                    }
                    r
                }
                None => x,
            };
            norm_row(src, self.weight, out, self.eps);
        }
    }
}

#[inline(always)]
fn norm_row<T: Elem>(x: &[T], weight: &[T], out: &mut [T], eps: f32) {
    const LANES: usize = 16;
    let mut sums = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks
        .remainder()
        .iter()
        .map(|v| v.to_f32() * v.to_f32())
        .sum();
    for chunk in chunks {
        for (s, v) in sums.iter_mut().zip(chunk) {
            *s += v.to_f32() * v.to_f32();
        }
    }
    let mean = (sums.iter().sum::<f32>() + tail) / x.len() as f32;
    let inv = 1.0 / (mean + eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = T::from_f32(round::<T>(v.to_f32() * inv) * w.to_f32());
    }
}

/// The activation on the gate of a gated MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// SwiGLU's `x * sigmoid(x)`.
    Silu,
    /// GeGLU's tanh GELU (torch's `gelu(approximate="tanh")`).
    GeluTanh,
}

impl Gate {
    pub fn from_name(name: &str) -> Result<Gate, AttnError> {
        match name {
            "silu" => Ok(Gate::Silu),
            "gelu_tanh" => Ok(Gate::GeluTanh),
            _ => err(format!(
                "gated_mul: activation {name:?} is not silu or gelu_tanh"
            )),
        }
    }
}

/// `out[r] = gate(x[r, :d]) * x[r, d:]` for rows of `2d` elements (`out`: rows of `d`).
pub fn gated_mul<T: Elem>(
    gate: Gate,
    x: &[T],
    out: &mut [T],
    d: usize,
    threads: usize,
) -> Result<(), AttnError> {
    if d == 0 || !out.len().is_multiple_of(d) || x.len() != 2 * out.len() {
        return err(format!(
            "gated_mul: x has {} elements and out {}; they must be [rows, {}] and [rows, {d}]",
            x.len(),
            out.len(),
            2 * d
        ));
    }
    let (rows, out) = (out.len() / d, Shared(out.as_mut_ptr()));
    match gate {
        Gate::Silu => for_rows(
            rows,
            2 * d,
            threads,
            &GatedJob {
                x,
                out,
                d,
                act: silu,
            },
        ),
        Gate::GeluTanh => for_rows(
            rows,
            2 * d,
            threads,
            &GatedJob {
                x,
                out,
                d,
                act: gelu_tanh,
            },
        ),
    }
    Ok(())
}

struct GatedJob<'a, T, A> {
    x: &'a [T],
    out: Shared<T>,
    d: usize,
    act: A,
}

impl<T: Elem, A: Fn(f32) -> f32 + Sync> RowJob for GatedJob<'_, T, A> {
    #[inline(always)]
    unsafe fn run(&self, from: usize, to: usize) {
        const LANES: usize = 16;
        let (d, act) = (self.d, &self.act);
        for row in from..to {
            let (gate, up) = self.x[row * 2 * d..][..2 * d].split_at(d);
            let out = self.out.rows(row * d, d);
            let whole = d - d % LANES;
            for j in (0..whole).step_by(LANES) {
                // fixed-width blocks, so that the loop (exp included) vectorizes
                let g: &[T; LANES] = gate[j..j + LANES].try_into().unwrap();
                let u: &[T; LANES] = up[j..j + LANES].try_into().unwrap();
                let o: &mut [T; LANES] = (&mut out[j..j + LANES]).try_into().unwrap();
                for l in 0..LANES {
                    o[l] = T::from_f32(round::<T>(act(g[l].to_f32())) * u[l].to_f32());
                }
            }
            for j in whole..d {
                out[j] = T::from_f32(round::<T>(act(gate[j].to_f32())) * up[j].to_f32());
            }
        }
    }
}

/// `1 / (1 + exp(-x))`, with exp only of non-positive arguments (no overflow, vectorizes).
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    let e = exp_nonpositive(-x.abs()); // exp(-|x|) in (0, 1]
    let numerator = if x >= 0.0 { 1.0 } else { e };
    numerator / (1.0 + e)
}

/// `x * sigmoid(x)`.
#[inline(always)]
fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `0.5 x (1 + tanh(u))` with `u = sqrt(2/pi) (x + 0.044715 x^3)`, written as `x sigmoid(2u)`.
#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    const TWO_C: f32 = 2.0 * 0.797_884_6; // 2 sqrt(2 / pi)
    x * sigmoid(TWO_C * (x + 0.044715 * x * x * x))
}
