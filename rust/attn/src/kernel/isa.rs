//! The kernel's two vector primitives (`Isa`: a dot product and `acc += a * x`, plus their
//! block forms) and the portable versions every instruction set falls back to.

use crate::KvElem;

const LANES: usize = 16;

/// The two vector primitives, per instruction set. `d` is the head dimension; slices hold
/// at least `d` elements.
pub(crate) trait Isa: Copy {
    /// SAFETY: the CPU has the features of this instruction set.
    unsafe fn dot<T: KvElem>(self, q: &[f32], key: &[T], d: usize) -> f32;
    /// `acc += a * x`. SAFETY: as `dot`.
    unsafe fn axpy<T: KvElem>(self, acc: &mut [f32], a: f32, x: &[T], d: usize);

    /// What the block primitives understate the true values of K/V of type T by (a power of
    /// two; 1 by default): `scores` takes q multiplied by it and `weighted_sum` returns the
    /// sum divided by it (AVX-512's fp8 e4m3 loads skip the scaling; the caller undoes it
    /// once per task, exactly). `dot` and `axpy` are never scaled.
    #[inline(always)]
    fn raw_scale<T: KvElem>(self) -> f32 {
        1.0
    }

    /// `out[t] = q . keys[t]` for a block of key rows (`d` elements each).
    /// SAFETY: as `dot`, and every pointer addresses `d` readable elements.
    #[inline(always)]
    unsafe fn scores<T: KvElem>(self, q: &[f32], keys: &[*const T], out: &mut [f32], d: usize) {
        scores_by_dot(self, q, keys, out, d)
    }

    /// `acc += sum_t weights[t] * values[t]` over a block of value rows.
    /// SAFETY: as `scores`.
    #[inline(always)]
    unsafe fn weighted_sum<T: KvElem>(
        self,
        acc: &mut [f32],
        weights: &[f32],
        values: &[*const T],
        d: usize,
    ) {
        weighted_sum_by_axpy(self, acc, weights, values, d)
    }
}

/// `Isa::scores` one dot product at a time. SAFETY: as `Isa::scores`.
#[inline(always)]
pub(crate) unsafe fn scores_by_dot<T: KvElem, I: Isa>(
    isa: I,
    q: &[f32],
    keys: &[*const T],
    out: &mut [f32],
    d: usize,
) {
    for (o, &key) in out.iter_mut().zip(keys) {
        *o = isa.dot(q, std::slice::from_raw_parts(key, d), d);
    }
}

/// `Isa::weighted_sum` one row at a time. SAFETY: as `Isa::weighted_sum`.
#[inline(always)]
pub(crate) unsafe fn weighted_sum_by_axpy<T: KvElem, I: Isa>(
    isa: I,
    acc: &mut [f32],
    weights: &[f32],
    values: &[*const T],
    d: usize,
) {
    for (&w, &value) in weights.iter().zip(values) {
        isa.axpy(acc, w, std::slice::from_raw_parts(value, d), d);
    }
}

#[derive(Clone, Copy)]
pub(crate) struct Portable;

impl Isa for Portable {
    #[inline(always)]
    unsafe fn dot<T: KvElem>(self, q: &[f32], key: &[T], d: usize) -> f32 {
        dot(q, key, d)
    }
    #[inline(always)]
    unsafe fn axpy<T: KvElem>(self, acc: &mut [f32], a: f32, x: &[T], d: usize) {
        axpy(acc, a, x, d)
    }
}

#[inline(always)]
pub(crate) fn dot<T: KvElem>(q: &[f32], key: &[T], d: usize) -> f32 {
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
pub(crate) fn axpy<T: KvElem>(acc: &mut [f32], a: f32, x: &[T], d: usize) {
    for (y, x) in acc[..d].iter_mut().zip(&x[..d]) {
        *y += a * x.to_f32();
    }
}
