//! `sglite._core.decode_attention`: the Python face of `cpu_attn::decode_attention`.
//!
//! Tensors cross as raw addresses with their element counts: the only caller,
//! `sglite.attention.cpu_kernel`, checks dtype, device and contiguity and keeps the tensors
//! alive for the call. Layout errors (sizes, rows, lengths, slot ids) raise ValueError and
//! write nothing. The computation runs without the GIL.

use cpu_attn::{AttnError, Bf16, Dims, Elem, Problem};
use pyo3::prelude::*;

use crate::convert::value_error;

/// A tensor's storage as the kernel sees it: address and element count.
struct Raw {
    addr: usize,
    len: usize,
}

impl Raw {
    fn new(name: &str, addr: usize, len: usize, align: usize) -> PyResult<Self> {
        if len > 0 && (addr == 0 || !addr.is_multiple_of(align)) {
            return Err(value_error(format!(
                "{name}: address {addr:#x} is null or misaligned"
            )));
        }
        Ok(Self { addr, len })
    }

    /// SAFETY: the caller guarantees `len` live elements of `T` at `addr` for the lifetime.
    unsafe fn slice<'a, T>(&self) -> &'a [T] {
        if self.len == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(self.addr as *const T, self.len)
        }
    }

    /// SAFETY: as `slice`, and nothing else reads or writes the memory meanwhile.
    unsafe fn slice_mut<'a, T>(&self) -> &'a mut [T] {
        if self.len == 0 {
            &mut []
        } else {
            std::slice::from_raw_parts_mut(self.addr as *mut T, self.len)
        }
    }
}

struct Args {
    q: Raw,
    k: Raw,
    v: Raw,
    out: Raw,
    table: Raw,
    table_width: usize,
    rows: Raw,
    seq_lens: Raw,
    dims: Dims,
    scale: f32,
}

/// SAFETY: see `Raw::slice`; `out` must not overlap the inputs.
unsafe fn run<T: Elem>(a: &Args, num_threads: usize) -> Result<(), AttnError> {
    let p = Problem {
        q: a.q.slice::<T>(),
        k: a.k.slice::<T>(),
        v: a.v.slice::<T>(),
        table: a.table.slice::<i32>(),
        table_width: a.table_width,
        rows: a.rows.slice::<i64>(),
        seq_lens: a.seq_lens.slice::<i64>(),
        dims: a.dims,
        scale: a.scale,
    };
    cpu_attn::decode_attention(&p, a.out.slice_mut::<T>(), num_threads)
}

/// Decode attention over one layer of the KV pool: see `sglite.attention.cpu_kernel`.
/// Each `(address, element count)` pair describes one contiguous CPU tensor; `dtype` is
/// "float32" or "bfloat16" (q, k, v and out), table is int32, rows and seq_lens int64.
#[pyfunction]
#[pyo3(signature = (q, k, v, out, table, table_width, rows, seq_lens, num_heads, num_kv_heads, head_dim, scale, dtype, num_threads))]
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    py: Python<'_>,
    q: (usize, usize),
    k: (usize, usize),
    v: (usize, usize),
    out: (usize, usize),
    table: (usize, usize),
    table_width: usize,
    rows: (usize, usize),
    seq_lens: (usize, usize),
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    dtype: &str,
    num_threads: usize,
) -> PyResult<()> {
    let elem = match dtype {
        "float32" => 4,
        "bfloat16" => 2,
        other => return Err(value_error(format!("dtype {other:?}: float32 or bfloat16"))),
    };
    let args = Args {
        q: Raw::new("q", q.0, q.1, elem)?,
        k: Raw::new("k", k.0, k.1, elem)?,
        v: Raw::new("v", v.0, v.1, elem)?,
        out: Raw::new("out", out.0, out.1, elem)?,
        table: Raw::new("table", table.0, table.1, 4)?,
        table_width,
        rows: Raw::new("rows", rows.0, rows.1, 8)?,
        seq_lens: Raw::new("seq_lens", seq_lens.0, seq_lens.1, 8)?,
        dims: Dims {
            num_heads,
            num_kv_heads,
            head_dim,
        },
        scale,
    };
    let result = py.allow_threads(|| {
        // SAFETY: the launcher passes live, contiguous tensors of these sizes (module doc).
        unsafe {
            if elem == 4 {
                run::<f32>(&args, num_threads)
            } else {
                run::<Bf16>(&args, num_threads)
            }
        }
    });
    result.map_err(|e| value_error(e.0))
}
