//! `sglite._core.DecodePlan`: the Python face of `cpu_attn::DecodePlan`.
//!
//! A plan is built once per forward pass from the request table (its rows are copied and
//! checked, rows sharing a cached prefix grouped) and run once per layer. Tensors cross as
//! raw addresses with their element counts: the only caller, `sglite.attention.cpu_kernel`,
//! checks dtype, device and contiguity and keeps the tensors alive for the call. Layout
//! errors (sizes, rows, lengths, slot ids) raise ValueError and write nothing. A run releases
//! the GIL.

use cpu_attn::{AttnError, Bf16, Dims, E4m3, E5m2, Elem, KvElem, Layer, Variant};
use pyo3::prelude::*;

use crate::convert::value_error;

/// A tensor's storage as the kernel sees it: address and element count.
pub(crate) struct Raw {
    addr: usize,
    len: usize,
}

impl Raw {
    pub(crate) fn new(name: &str, (addr, len): (usize, usize), align: usize) -> PyResult<Self> {
        if len > 0 && (addr == 0 || !addr.is_multiple_of(align)) {
            return Err(value_error(format!(
                "{name}: address {addr:#x} is null or misaligned"
            )));
        }
        Ok(Self { addr, len })
    }

    /// SAFETY: the caller guarantees `len` live elements of `T` at `addr` for the lifetime.
    pub(crate) unsafe fn slice<'a, T>(&self) -> &'a [T] {
        if self.len == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(self.addr as *const T, self.len)
        }
    }

    /// SAFETY: as `slice`, and nothing else reads or writes the memory meanwhile.
    pub(crate) unsafe fn slice_mut<'a, T>(&self) -> &'a mut [T] {
        if self.len == 0 {
            &mut []
        } else {
            std::slice::from_raw_parts_mut(self.addr as *mut T, self.len)
        }
    }
}

/// How many times the CPU kernels' thread team was found waiting on itself (shared cores)
/// and ran on the calling thread alone for a second (`cpu_attn::contention`).
#[pyfunction]
pub fn team_solo_spells() -> u64 {
    cpu_attn::contention::solo_spells()
}

/// Decode attention of one batch: see `sglite.attention.cpu_kernel`.
#[pyclass(name = "DecodePlan", module = "sglite._core", frozen)]
pub struct PyDecodePlan {
    inner: cpu_attn::DecodePlan,
}

impl PyDecodePlan {
    pub(crate) fn inner(&self) -> &cpu_attn::DecodePlan {
        &self.inner
    }
}

#[pymethods]
impl PyDecodePlan {
    /// `table` int32 `[rows, table_width]`, `rows` and `seq_lens` int64 `[n]`, each as
    /// `(address, element count)` of a contiguous CPU tensor; read here, not kept. `window`:
    /// each row keeps its last `window` keys only (None: all).
    #[new]
    #[pyo3(signature = (table, table_width, rows, seq_lens, num_kv_heads, window=None))]
    fn new(
        table: (usize, usize),
        table_width: usize,
        rows: (usize, usize),
        seq_lens: (usize, usize),
        num_kv_heads: usize,
        window: Option<usize>,
    ) -> PyResult<Self> {
        let (table, rows, seq_lens) = (
            Raw::new("table", table, 4)?,
            Raw::new("rows", rows, 8)?,
            Raw::new("seq_lens", seq_lens, 8)?,
        );
        // SAFETY: the launcher passes live, contiguous tensors of these sizes (module doc).
        let inner = unsafe {
            cpu_attn::DecodePlan::new(
                table.slice::<i32>(),
                table_width,
                rows.slice::<i64>(),
                seq_lens.slice::<i64>(),
                num_kv_heads,
                window,
            )
        };
        Ok(Self {
            inner: inner.map_err(|e| value_error(e.0))?,
        })
    }

    #[getter]
    fn num_rows(&self) -> usize {
        self.inner.num_rows()
    }

    /// One layer: q `[n, num_heads, head_dim]`, out `[n, num_heads, v_dim]`, k `[num_slots,
    /// num_kv_heads, head_dim]`, v `[num_slots, num_kv_heads, >= v_dim]` (see `cpu_attn`; None:
    /// `head_dim`); q and out "float32" or "bfloat16" (`dtype`), k and v `kv_dtype` (None:
    /// `dtype`): the same, or with float32 q "bfloat16", and "float8_e4m3fn" or
    /// "float8_e5m2" under either; `logit_cap` (0: none) and `sinks` (float32 `[num_heads]`,
    /// or None) as in `cpu_attn::Variant`.
    #[pyo3(signature = (
        q, k, v, out, num_heads, num_kv_heads, head_dim, scale, dtype, num_threads,
        logit_cap=0.0, sinks=None, v_dim=None, kv_dtype=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        q: (usize, usize),
        k: (usize, usize),
        v: (usize, usize),
        out: (usize, usize),
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        scale: f32,
        dtype: &str,
        num_threads: usize,
        logit_cap: f32,
        sinks: Option<(usize, usize)>,
        v_dim: Option<usize>,
        kv_dtype: Option<&str>,
    ) -> PyResult<()> {
        let kv_dtype = kv_dtype.unwrap_or(dtype);
        let pair = match (dtype, kv_dtype) {
            ("float32", "float32") => Pair::F32,
            ("bfloat16", "bfloat16") => Pair::Bf16,
            ("float32", "bfloat16") => Pair::F32Bf16,
            ("float32", "float8_e4m3fn") => Pair::F32E4m3,
            ("float32", "float8_e5m2") => Pair::F32E5m2,
            ("bfloat16", "float8_e4m3fn") => Pair::Bf16E4m3,
            ("bfloat16", "float8_e5m2") => Pair::Bf16E5m2,
            (q, kv) => {
                return Err(value_error(format!(
                    "dtypes {q:?} (q) and {kv:?} (K/V): q float32 or bfloat16, K/V the same, \
                     bfloat16 under float32, or float8_e4m3fn / float8_e5m2"
                )))
            }
        };
        let (elem, kv_elem) = pair.sizes();
        let (q, k, v, out) = (
            Raw::new("q", q, elem)?,
            Raw::new("k", k, kv_elem)?,
            Raw::new("v", v, kv_elem)?,
            Raw::new("out", out, elem)?,
        );
        let sinks = sinks.map(|s| Raw::new("sinks", s, 4)).transpose()?;
        let dims = Dims {
            num_heads,
            num_kv_heads,
            head_dim,
            v_dim: v_dim.unwrap_or(head_dim),
        };
        let plan = &self.inner;
        let result = py.allow_threads(|| {
            // SAFETY: as in `new`; `out` does not overlap the inputs.
            unsafe {
                let variant = Variant {
                    logit_cap,
                    sinks: sinks.as_ref().map(|s| s.slice::<f32>()),
                };
                let shape = Shape {
                    dims,
                    scale,
                    variant,
                };
                let args = ([&q, &k, &v], &out, shape, num_threads);
                match pair {
                    Pair::F32 => run::<f32, f32>(plan, args),
                    Pair::Bf16 => run::<Bf16, Bf16>(plan, args),
                    Pair::F32Bf16 => run::<f32, Bf16>(plan, args),
                    Pair::F32E4m3 => run::<f32, E4m3>(plan, args),
                    Pair::F32E5m2 => run::<f32, E5m2>(plan, args),
                    Pair::Bf16E4m3 => run::<Bf16, E4m3>(plan, args),
                    Pair::Bf16E5m2 => run::<Bf16, E5m2>(plan, args),
                }
            }
        });
        result.map_err(|e| value_error(e.0))
    }
}

/// The (q and out, K and V) element types a run may take.
#[derive(Clone, Copy)]
enum Pair {
    F32,
    Bf16,
    F32Bf16,
    F32E4m3,
    F32E5m2,
    Bf16E4m3,
    Bf16E5m2,
}

impl Pair {
    /// Element sizes of q/out and of K/V.
    fn sizes(self) -> (usize, usize) {
        match self {
            Pair::F32 => (4, 4),
            Pair::Bf16 => (2, 2),
            Pair::F32Bf16 => (4, 2),
            Pair::F32E4m3 | Pair::F32E5m2 => (4, 1),
            Pair::Bf16E4m3 | Pair::Bf16E5m2 => (2, 1),
        }
    }
}

/// A layer's head layout, softmax scale and variant.
struct Shape<'a> {
    dims: Dims,
    scale: f32,
    variant: Variant<'a>,
}

/// The tensors, the layer's shape and the thread count of one run.
type RunArgs<'a, 'b> = ([&'a Raw; 3], &'a Raw, Shape<'b>, usize);

/// SAFETY: see `Raw::slice`.
unsafe fn run<T: Elem, K: KvElem>(
    plan: &cpu_attn::DecodePlan,
    ([q, k, v], out, shape, num_threads): RunArgs<'_, '_>,
) -> Result<(), AttnError> {
    let layer = Layer {
        q: q.slice::<T>(),
        k: k.slice::<K>(),
        v: v.slice::<K>(),
        dims: shape.dims,
        scale: shape.scale,
        variant: shape.variant,
    };
    plan.run(&layer, out.slice_mut::<T>(), num_threads)
}

/// `set_openmp_parallel(address)`: run the kernel's threads on the OpenMP team whose
/// `GOMP_parallel` is at `address` (see `cpu_attn::pool`); 0 goes back to threads of its own.
/// The caller (`sglite.attention.cpu_kernel`) passes the function of the runtime torch loaded,
/// which stays loaded for the life of the process.
#[pyfunction]
pub fn set_openmp_parallel(address: usize) {
    // SAFETY: the caller's contract above.
    unsafe { cpu_attn::pool::set_openmp_parallel(address) }
}
