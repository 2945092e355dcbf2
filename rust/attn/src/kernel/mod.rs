//! The inner loops: one task is one (query row, KV head) pair.
//!
//! The head dimension is a compile-time constant in the common cases (64, 128) so that the
//! dot products and the value accumulation unroll into whole vector registers; other sizes
//! take the same code with a run-time length. The next keys' rows are prefetched: a row's
//! slots are scattered over the pool, which the hardware prefetcher cannot follow.

use crate::{exp, Dims, Elem, Problem};

#[cfg(target_arch = "x86_64")]
mod x86;

/// Keys ahead of the current one whose rows are prefetched.
const PREFETCH_AHEAD: usize = 12;
const LANES: usize = 16;

pub(crate) fn run_tasks<T: Elem>(p: &Problem<'_, T>, first: usize, last: usize, out: &mut [T]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above).
            return unsafe { run_avx512(p, first, last, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            return unsafe { run_avx2(p, first, last, out) };
        }
    }
    // SAFETY: the portable loops need no CPU feature.
    unsafe { dispatch_dim(p, first, last, out, Portable) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn run_avx512<T: Elem>(p: &Problem<'_, T>, first: usize, last: usize, out: &mut [T]) {
    dispatch_dim(p, first, last, out, x86::Avx512)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2<T: Elem>(p: &Problem<'_, T>, first: usize, last: usize, out: &mut [T]) {
    dispatch_dim(p, first, last, out, x86::Avx2)
}

/// SAFETY: the CPU has the features `isa` needs.
#[inline(always)]
unsafe fn dispatch_dim<T: Elem, I: Isa>(
    p: &Problem<'_, T>,
    first: usize,
    last: usize,
    out: &mut [T],
    isa: I,
) {
    match p.dims.head_dim {
        64 => run_body(p, first, last, out, Fixed::<64>, isa),
        128 => run_body(p, first, last, out, Fixed::<128>, isa),
        d => run_body(p, first, last, out, Any(d), isa),
    }
}

/// The two vector primitives, per instruction set. `d` is the head dimension; slices hold
/// at least `d` elements.
pub(crate) trait Isa: Copy {
    /// SAFETY: the CPU has the features of this instruction set.
    unsafe fn dot<T: Elem>(self, q: &[f32], key: &[T], d: usize) -> f32;
    /// `acc += a * x`. SAFETY: as `dot`.
    unsafe fn axpy<T: Elem>(self, acc: &mut [f32], a: f32, x: &[T], d: usize);
}

#[derive(Clone, Copy)]
struct Portable;

impl Isa for Portable {
    #[inline(always)]
    unsafe fn dot<T: Elem>(self, q: &[f32], key: &[T], d: usize) -> f32 {
        dot(q, key, d)
    }
    #[inline(always)]
    unsafe fn axpy<T: Elem>(self, acc: &mut [f32], a: f32, x: &[T], d: usize) {
        axpy(acc, a, x, d)
    }
}

/// The head dimension: a constant the compiler unrolls, or a run-time value.
trait HeadDim: Copy {
    fn get(self) -> usize;
}

#[derive(Clone, Copy)]
struct Fixed<const D: usize>;

impl<const D: usize> HeadDim for Fixed<D> {
    #[inline(always)]
    fn get(self) -> usize {
        D
    }
}

#[derive(Clone, Copy)]
struct Any(usize);

impl HeadDim for Any {
    #[inline(always)]
    fn get(self) -> usize {
        self.0
    }
}

#[inline(always)]
fn prefetch<T>(row: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = std::mem::size_of_val(row);
        let base = row.as_ptr() as *const i8;
        let mut at = 0;
        while at < bytes {
            // SAFETY: prefetch never faults; the address is inside `row`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(base.add(at)) };
            at += 64;
        }
    }
}

#[inline(always)]
pub(crate) fn dot<T: Elem>(q: &[f32], key: &[T], d: usize) -> f32 {
    let (q, key) = (&q[..d], &key[..d]);
    let mut acc = [0f32; LANES];
    let whole = d - d % LANES;
    for (x, y) in q[..whole]
        .chunks_exact(LANES)
        .zip(key[..whole].chunks_exact(LANES))
    {
        for j in 0..LANES {
            acc[j] += x[j] * y[j].to_f32();
        }
    }
    let mut sum = 0.0;
    for (x, y) in q[whole..].iter().zip(&key[whole..]) {
        sum += x * y.to_f32();
    }
    let mut width = LANES / 2;
    while width > 0 {
        for j in 0..width {
            acc[j] += acc[j + width];
        }
        width /= 2;
    }
    acc[0] + sum
}

#[inline(always)]
pub(crate) fn axpy<T: Elem>(acc: &mut [f32], a: f32, x: &[T], d: usize) {
    for (y, x) in acc[..d].iter_mut().zip(&x[..d]) {
        *y += a * x.to_f32();
    }
}

/// Tasks `first..last` (task = row * num_kv_heads + KV head); `out` holds exactly their output.
/// SAFETY: the CPU has the features `isa` needs.
#[inline(always)]
unsafe fn run_body<T: Elem, H: HeadDim, I: Isa>(
    p: &Problem<'_, T>,
    first: usize,
    last: usize,
    out: &mut [T],
    dim: H,
    isa: I,
) {
    let Dims {
        num_heads,
        num_kv_heads,
        ..
    } = p.dims;
    let d = dim.get();
    let group = num_heads / num_kv_heads;
    let task_len = group * d;
    let mut q = vec![0f32; task_len];
    let mut acc = vec![0f32; task_len];
    let mut sums = vec![0f32; group];
    let mut scores: Vec<f32> = Vec::new();
    let row_of = |buf: &'_ [T], slot: i32, h: usize| -> std::ops::Range<usize> {
        let at = (slot as usize * num_kv_heads + h) * d;
        let _ = &buf[at..at + d];
        at..at + d
    };
    for (task, out) in (first..last).zip(out.chunks_exact_mut(task_len)) {
        let (i, h) = (task / num_kv_heads, task % num_kv_heads);
        let len = p.seq_lens[i] as usize;
        let start = p.rows[i] as usize * p.table_width;
        let slots = &p.table[start..start + len];
        let q_start = task * task_len; // == (i * num_heads + h * group) * d
        for (x, y) in q.iter_mut().zip(&p.q[q_start..q_start + task_len]) {
            *x = y.to_f32() * p.scale;
        }
        scores.clear();
        scores.resize(group * len, 0.0);
        for (t, &slot) in slots.iter().enumerate() {
            if let Some(&ahead) = slots.get(t + PREFETCH_AHEAD) {
                prefetch(&p.k[row_of(p.k, ahead, h)]);
            }
            let key = &p.k[row_of(p.k, slot, h)];
            for (g, qg) in q.chunks_exact(d).enumerate() {
                scores[g * len + t] = isa.dot(qg, key, d);
            }
        }
        for (g, row) in scores.chunks_exact_mut(len).enumerate() {
            sums[g] = exp::softmax_numerators(row);
        }
        acc.fill(0.0);
        for (t, &slot) in slots.iter().enumerate() {
            if let Some(&ahead) = slots.get(t + PREFETCH_AHEAD) {
                prefetch(&p.v[row_of(p.v, ahead, h)]);
            }
            let value = &p.v[row_of(p.v, slot, h)];
            for (g, acc_g) in acc.chunks_exact_mut(d).enumerate() {
                isa.axpy(acc_g, scores[g * len + t], value, d);
            }
        }
        for (g, (o, a)) in out.chunks_exact_mut(d).zip(acc.chunks_exact(d)).enumerate() {
            let inv = 1.0 / sums[g];
            for (o, a) in o.iter_mut().zip(a) {
                *o = T::from_f32(a * inv);
            }
        }
    }
}
