//! `sglite._core.rms_norm`, `gated_mul`, `rope`: the Python face of `cpu_attn::ops`, the
//! decoder layer's fused element-wise steps on the CPU; `kv_store`: `cpu_attn::store`.
//!
//! As with `DecodePlan`, tensors cross as `(address, element count)`; the only caller,
//! `sglite.layers.cpu_ops`, checks device, dtype and layout and keeps the tensors alive for
//! the call. Size mismatches raise ValueError and write nothing.

use cpu_attn::ops::{self, HeadRows};
use cpu_attn::store::{self, Rows, StoreKind};
use cpu_attn::{AttnError, Bf16, Elem};
use pyo3::prelude::*;

use crate::attn::Raw;
use crate::convert::value_error;

/// Element size of a dtype name.
fn elem_size(dtype: &str) -> PyResult<usize> {
    match dtype {
        "float32" => Ok(4),
        "bfloat16" => Ok(2),
        other => Err(value_error(format!("dtype {other:?}: float32 or bfloat16"))),
    }
}

fn to_py<R>(r: Result<R, AttnError>) -> PyResult<R> {
    r.map_err(|e| value_error(e.0))
}

/// `out = rms_norm(x) * weight` per row; with `residual`, `residual += x` first (in place) and
/// the sum is normalised.
#[pyfunction]
#[pyo3(signature = (x, residual, weight, out, eps, dtype, num_threads))]
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    py: Python<'_>,
    x: (usize, usize),
    residual: Option<(usize, usize)>,
    weight: (usize, usize),
    out: (usize, usize),
    eps: f32,
    dtype: &str,
    num_threads: usize,
) -> PyResult<()> {
    let size = elem_size(dtype)?;
    let (x, weight, out) = (
        Raw::new("x", x, size)?,
        Raw::new("weight", weight, size)?,
        Raw::new("out", out, size)?,
    );
    let residual = residual
        .map(|r| Raw::new("residual", r, size))
        .transpose()?;
    // SAFETY: the caller passes live tensors of these sizes; out and residual overlap nothing.
    unsafe fn run<T: Elem>(
        x: &Raw,
        residual: Option<&Raw>,
        weight: &Raw,
        out: &Raw,
        eps: f32,
        threads: usize,
    ) -> Result<(), AttnError> {
        let residual = residual.map(|r| r.slice_mut::<T>());
        ops::rms_norm(
            x.slice::<T>(),
            residual,
            weight.slice(),
            out.slice_mut(),
            eps,
            threads,
        )
    }
    to_py(py.allow_threads(|| unsafe {
        if size == 4 {
            run::<f32>(&x, residual.as_ref(), &weight, &out, eps, num_threads)
        } else {
            run::<Bf16>(&x, residual.as_ref(), &weight, &out, eps, num_threads)
        }
    }))
}

/// `out[r] = act(x[r, :d]) * x[r, d:]`, `activation` "silu" or "gelu_tanh".
#[pyfunction]
pub fn gated_mul(
    py: Python<'_>,
    x: (usize, usize),
    out: (usize, usize),
    d: usize,
    activation: &str,
    dtype: &str,
    num_threads: usize,
) -> PyResult<()> {
    let gate = to_py(ops::Gate::from_name(activation))?;
    let size = elem_size(dtype)?;
    let (x, out) = (Raw::new("x", x, size)?, Raw::new("out", out, size)?);
    // SAFETY: as in `rms_norm`.
    to_py(py.allow_threads(|| unsafe {
        if size == 4 {
            ops::gated_mul(gate, x.slice::<f32>(), out.slice_mut(), d, num_threads)
        } else {
            ops::gated_mul(gate, x.slice::<Bf16>(), out.slice_mut(), d, num_threads)
        }
    }))
}

/// Rotary embedding of q and k (rows of `heads` heads every `stride` elements) at
/// `positions` (int64), into contiguous `q_out` and `k_out`.
#[pyfunction]
#[pyo3(signature = (positions, table, q, q_stride, q_heads, k, k_stride, k_heads, q_out, k_out, head_dim, dtype, num_threads))]
#[allow(clippy::too_many_arguments)]
pub fn rope(
    py: Python<'_>,
    positions: (usize, usize),
    table: (usize, usize),
    q: (usize, usize),
    q_stride: usize,
    q_heads: usize,
    k: (usize, usize),
    k_stride: usize,
    k_heads: usize,
    q_out: (usize, usize),
    k_out: (usize, usize),
    head_dim: usize,
    dtype: &str,
    num_threads: usize,
) -> PyResult<()> {
    let size = elem_size(dtype)?;
    let positions = Raw::new("positions", positions, 8)?;
    let (table, q, k, q_out, k_out) = (
        Raw::new("table", table, size)?,
        Raw::new("q", q, size)?,
        Raw::new("k", k, size)?,
        Raw::new("q_out", q_out, size)?,
        Raw::new("k_out", k_out, size)?,
    );
    // SAFETY: as in `rms_norm`.
    unsafe fn run<T: Elem>(
        raws: [&Raw; 6],
        strides: [usize; 2],
        heads: [usize; 2],
        head_dim: usize,
        threads: usize,
    ) -> Result<(), AttnError> {
        let [positions, table, q, k, q_out, k_out] = raws;
        let q = HeadRows {
            data: q.slice::<T>(),
            row_stride: strides[0],
            heads: heads[0],
        };
        let k = HeadRows {
            data: k.slice::<T>(),
            row_stride: strides[1],
            heads: heads[1],
        };
        let (q_out, k_out) = (q_out.slice_mut(), k_out.slice_mut());
        ops::rope(
            positions.slice(),
            table.slice(),
            &q,
            &k,
            q_out,
            k_out,
            head_dim,
            threads,
        )
    }
    let raws = [&positions, &table, &q, &k, &q_out, &k_out];
    let (strides, heads) = ([q_stride, k_stride], [q_heads, k_heads]);
    to_py(py.allow_threads(|| unsafe {
        if size == 4 {
            run::<f32>(raws, strides, heads, head_dim, num_threads)
        } else {
            run::<Bf16>(raws, strides, heads, head_dim, num_threads)
        }
    }))
}

/// `pool[slots[t]] = rows[t]` converted to `pool_dtype` (float32, bfloat16, float8_e4m3fn,
/// float8_e5m2): `rows` are `len(slots)` rows of `width` elements of `dtype`, `row_stride`
/// apart; `pool` is the layer's buffer as `(address, bytes)`.
#[pyfunction]
#[pyo3(signature = (rows, row_stride, width, slots, pool, dtype, pool_dtype, num_threads))]
#[allow(clippy::too_many_arguments)]
pub fn kv_store(
    py: Python<'_>,
    rows: (usize, usize),
    row_stride: usize,
    width: usize,
    slots: (usize, usize),
    pool: (usize, usize),
    dtype: &str,
    pool_dtype: &str,
    num_threads: usize,
) -> PyResult<()> {
    let size = elem_size(dtype)?;
    let kind = StoreKind::from_name(pool_dtype).ok_or_else(|| {
        value_error(format!(
            "pool dtype {pool_dtype:?}: float32, bfloat16, float8_e4m3fn or float8_e5m2"
        ))
    })?;
    let (rows, slots, pool) = (
        Raw::new("rows", rows, size)?,
        Raw::new("slots", slots, 8)?,
        Raw::new("pool", pool, kind.size())?,
    );
    // SAFETY: the caller passes live tensors of these sizes; the pool overlaps neither input.
    unsafe fn run<T: Elem>(
        rows: &Raw,
        (row_stride, width): (usize, usize),
        slots: &Raw,
        pool: &Raw,
        kind: StoreKind,
        threads: usize,
    ) -> Result<(), AttnError> {
        let rows = Rows {
            data: rows.slice::<T>(),
            row_stride,
            width,
        };
        store::store(&rows, slots.slice(), pool.slice_mut(), kind, threads)
    }
    to_py(py.allow_threads(|| unsafe {
        if size == 4 {
            run::<f32>(&rows, (row_stride, width), &slots, &pool, kind, num_threads)
        } else {
            run::<Bf16>(&rows, (row_stride, width), &slots, &pool, kind, num_threads)
        }
    }))
}
