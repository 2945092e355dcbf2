//! `sglite._core.quant_*`: the Python face of the `quant` crate (GGUF block-quantized
//! weights on the CPU: dequantize, GEMV and GEMM).
//!
//! As with the attention kernels, tensors cross as `(address, element count)`: the only
//! caller, `sglite.layers.quant_kernels`, checks device, dtype and contiguity and keeps the
//! tensors alive for the call. Every size, stride and name is checked here again (a
//! ValueError, nothing written) before a kernel runs; runs release the GIL.

use pyo3::prelude::*;
use pyo3::types::PyTuple;
use quant::{Isa, Kernel, Panels, Precision, QType, QuantError, Run, Weights};

use crate::attn::Raw;
use crate::convert::value_error;

fn to_py<T>(r: Result<T, QuantError>) -> PyResult<T> {
    r.map_err(|e| value_error(e.0))
}

fn qtype(name: &str) -> PyResult<QType> {
    QType::from_name(name).ok_or_else(|| {
        let known: Vec<_> = QType::ALL.iter().map(|t| t.name()).collect();
        value_error(format!("quant type {name:?}: one of {}", known.join(", ")))
    })
}

fn isa(name: Option<&str>) -> PyResult<Isa> {
    match name {
        None => Ok(Isa::best()),
        Some(name) => Isa::from_name(name)
            .ok_or_else(|| value_error(format!("isa {name:?}: scalar, avx2, avx2vnni or avx512"))),
    }
}

fn kernel(name: Option<&str>) -> PyResult<Option<Kernel>> {
    name.map(|name| {
        Kernel::from_name(name)
            .ok_or_else(|| value_error(format!("kernel {name:?}: gemv or gemm_f32")))
    })
    .transpose()
}

/// `y[r, :rows] = x[r] . W^T` for the `n` rows of x `[n, cols]` (f32), W `rows` rows of
/// `cols` weights in `qtype` blocks, `row_stride` bytes apart; y rows `ld_y` apart.
/// Returns the kernel's name.
#[pyfunction]
#[pyo3(signature = (qtype_name, w, rows, cols, row_stride, x, n, y, ld_y, isa_name, kernel_name, num_threads))]
#[allow(clippy::too_many_arguments)]
pub fn quant_matmul(
    py: Python<'_>,
    qtype_name: &str,
    w: (usize, usize),
    rows: usize,
    cols: usize,
    row_stride: usize,
    x: (usize, usize),
    n: usize,
    y: (usize, usize),
    ld_y: usize,
    isa_name: Option<&str>,
    kernel_name: Option<&str>,
    num_threads: usize,
) -> PyResult<&'static str> {
    let (qtype, isa, kernel) = (qtype(qtype_name)?, isa(isa_name)?, kernel(kernel_name)?);
    let (w, x, y) = (
        Raw::new("w", w, 1)?,
        Raw::new("x", x, 4)?,
        Raw::new("y", y, 4)?,
    );
    let run = Run {
        isa,
        kernel,
        threads: num_threads,
    };
    // SAFETY: the launcher passes live tensors of these sizes; y overlaps neither input.
    let ran = py.allow_threads(|| unsafe {
        let w = Weights::new(qtype, w.slice::<u8>(), rows, cols, row_stride)?;
        quant::matmul(&w, x.slice::<f32>(), n, y.slice_mut::<f32>(), ld_y, run)
    });
    to_py(ran).map(Kernel::name)
}

/// One weight of a `quant_matmul_many` call: (qtype name, w, rows, row stride, first column).
type Segment = (String, (usize, usize), usize, usize, usize);

/// `quant_matmul` of several weights of one `cols` sharing x, each segment `(qtype_name, w,
/// rows, row_stride, col)` writing y's columns `col..col + rows` (`quant::matmul_segments`).
#[pyfunction]
#[pyo3(signature = (segments, cols, x, n, y, ld_y, isa_name, kernel_name, num_threads))]
#[allow(clippy::too_many_arguments)]
pub fn quant_matmul_many(
    py: Python<'_>,
    segments: Vec<Segment>,
    cols: usize,
    x: (usize, usize),
    n: usize,
    y: (usize, usize),
    ld_y: usize,
    isa_name: Option<&str>,
    kernel_name: Option<&str>,
    num_threads: usize,
) -> PyResult<&'static str> {
    let (isa, kernel) = (isa(isa_name)?, kernel(kernel_name)?);
    let mut raws = Vec::with_capacity(segments.len());
    for (name, w, rows, row_stride, col) in &segments {
        raws.push((
            qtype(name)?,
            Raw::new("w", *w, 1)?,
            *rows,
            *row_stride,
            *col,
        ));
    }
    let (x, y) = (Raw::new("x", x, 4)?, Raw::new("y", y, 4)?);
    let run = Run {
        isa,
        kernel,
        threads: num_threads,
    };
    // SAFETY: as in `quant_matmul`; y overlaps no weight.
    let ran = py.allow_threads(|| unsafe {
        let mut ws = Vec::with_capacity(raws.len());
        for (qtype, w, rows, row_stride, col) in &raws {
            ws.push((
                Weights::new(*qtype, w.slice::<u8>(), *rows, cols, *row_stride)?,
                *col,
            ));
        }
        quant::matmul_segments(&ws, x.slice::<f32>(), n, y.slice_mut::<f32>(), ld_y, run)
    });
    to_py(ran).map(Kernel::name)
}

/// `out [rows, cols] = W` in f32 (W as in `quant_matmul`).
#[pyfunction]
#[pyo3(signature = (qtype_name, w, rows, cols, row_stride, out, isa_name, num_threads))]
#[allow(clippy::too_many_arguments)]
pub fn quant_dequantize(
    py: Python<'_>,
    qtype_name: &str,
    w: (usize, usize),
    rows: usize,
    cols: usize,
    row_stride: usize,
    out: (usize, usize),
    isa_name: Option<&str>,
    num_threads: usize,
) -> PyResult<()> {
    let (qtype, isa) = (qtype(qtype_name)?, isa(isa_name)?);
    let (w, out) = (Raw::new("w", w, 1)?, Raw::new("out", out, 4)?);
    // SAFETY: as in `quant_matmul`.
    to_py(py.allow_threads(|| unsafe {
        let w = Weights::new(qtype, w.slice::<u8>(), rows, cols, row_stride)?;
        quant::dequantize(&w, out.slice_mut::<f32>(), isa, num_threads)
    }))
}

/// Bytes of `rows` x `cols` weights of `qtype` in panels (`quant::panel`).
#[pyfunction]
pub fn quant_panel_bytes(qtype_name: &str, rows: usize, cols: usize) -> PyResult<usize> {
    let qtype = qtype(qtype_name)?;
    if cols == 0 || !cols.is_multiple_of(qtype.block_len()) {
        return Err(value_error(format!(
            "in_features={cols} is not a positive multiple of {qtype_name}'s block of {}",
            qtype.block_len()
        )));
    }
    Ok(quant::panel_bytes(qtype, rows, cols))
}

/// `out` (uint8, `quant_panel_bytes` long) = W (as in `quant_matmul`) repacked into panels.
#[pyfunction]
#[pyo3(signature = (qtype_name, w, rows, cols, row_stride, out, num_threads))]
#[allow(clippy::too_many_arguments)]
pub fn quant_repack(
    py: Python<'_>,
    qtype_name: &str,
    w: (usize, usize),
    rows: usize,
    cols: usize,
    row_stride: usize,
    out: (usize, usize),
    num_threads: usize,
) -> PyResult<()> {
    let qtype = qtype(qtype_name)?;
    let (w, out) = (Raw::new("w", w, 1)?, Raw::new("out", out, 1)?);
    // SAFETY: the launcher passes live tensors of these sizes; out overlaps no weight.
    to_py(py.allow_threads(|| unsafe {
        let w = Weights::new(qtype, w.slice::<u8>(), rows, cols, row_stride)?;
        quant::repack(&w, out.slice_mut::<u8>(), num_threads)
    }))
}

/// `out [rows, cols]` (f32) = the weights in panels at `w`.
#[pyfunction]
#[pyo3(signature = (qtype_name, w, rows, cols, out))]
pub fn quant_panel_dequantize(
    py: Python<'_>,
    qtype_name: &str,
    w: (usize, usize),
    rows: usize,
    cols: usize,
    out: (usize, usize),
) -> PyResult<()> {
    let qtype = qtype(qtype_name)?;
    let (w, out) = (Raw::new("w", w, 1)?, Raw::new("out", out, 4)?);
    // SAFETY: as in `quant_matmul`.
    to_py(py.allow_threads(|| unsafe {
        let w = Panels::new(qtype, w.slice::<u8>(), rows, cols)?;
        quant::panel::dequantize(&w, out.slice_mut::<f32>())
    }))
}

/// One weight of a `quant_panel_matmul` call: (qtype name, panels, rows, first column).
type PanelSegment = (String, (usize, usize), usize, usize);

/// `y[:, col_s .. col_s + rows_s] = x W_s^T` for each segment of panels `(qtype_name, w,
/// rows, col)` of one `cols`, x rounded once to `precision` ("int8" or "int16").
#[pyfunction]
#[pyo3(signature = (segments, cols, x, n, y, ld_y, precision, isa_name, num_threads))]
#[allow(clippy::too_many_arguments)]
pub fn quant_panel_matmul(
    py: Python<'_>,
    segments: Vec<PanelSegment>,
    cols: usize,
    x: (usize, usize),
    n: usize,
    y: (usize, usize),
    ld_y: usize,
    precision: &str,
    isa_name: Option<&str>,
    num_threads: usize,
) -> PyResult<()> {
    let isa = isa(isa_name)?;
    let precision = Precision::from_name(precision)
        .ok_or_else(|| value_error(format!("precision {precision:?}: int8 or int16")))?;
    let mut raws = Vec::with_capacity(segments.len());
    for (name, w, rows, col) in &segments {
        raws.push((qtype(name)?, Raw::new("w", *w, 1)?, *rows, *col));
    }
    let (x, y) = (Raw::new("x", x, 4)?, Raw::new("y", y, 4)?);
    // SAFETY: as in `quant_matmul`; y overlaps no weight.
    to_py(py.allow_threads(|| unsafe {
        let mut ws = Vec::with_capacity(raws.len());
        for (qtype, w, rows, col) in &raws {
            ws.push((Panels::new(*qtype, w.slice::<u8>(), *rows, cols)?, *col));
        }
        let (x, y) = (x.slice::<f32>(), y.slice_mut::<f32>());
        quant::panel_matmul_segments(&ws, x, n, y, ld_y, precision, isa, num_threads)
    }))
}

/// Cap every CPU kernel's instructions at `name` (scalar, avx2, avx2vnni or avx512), e.g. to
/// run the AVX2 paths on an AVX-512 machine; returns the fastest the kernels now use.
#[pyfunction]
pub fn limit_cpu_isa(name: &str) -> PyResult<&'static str> {
    let level = cpu_attn::isa_cap::LEVELS
        .iter()
        .position(|l| *l == name)
        .ok_or_else(|| {
            value_error(format!(
                "cpu isa {name:?}: scalar, avx2, avx2vnni or avx512"
            ))
        })?;
    cpu_attn::isa_cap::set_level(level as u8);
    Ok(Isa::best().name())
}

/// The instruction sets this CPU runs the kernels with, fastest first.
#[pyfunction]
pub fn quant_isas() -> Vec<&'static str> {
    let mut isas: Vec<_> = Isa::ALL.iter().filter(|i| i.is_available()).collect();
    isas.reverse();
    isas.into_iter().map(|i| i.name()).collect()
}

/// Registers the functions and `QUANT_TYPES` (name -> (block_len, block_bytes, ggml id)).
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quant_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(quant_matmul_many, m)?)?;
    m.add_function(wrap_pyfunction!(quant_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(quant_isas, m)?)?;
    m.add_function(wrap_pyfunction!(limit_cpu_isa, m)?)?;
    m.add_function(wrap_pyfunction!(quant_panel_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(quant_repack, m)?)?;
    m.add_function(wrap_pyfunction!(quant_panel_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(quant_panel_dequantize, m)?)?;
    let types = pyo3::types::PyDict::new(m.py());
    for t in QType::ALL {
        let info = (t.block_len(), t.block_bytes(), t.ggml_type());
        types.set_item(
            t.name(),
            PyTuple::new(m.py(), [info.0, info.1, info.2 as usize])?,
        )?;
    }
    m.add("QUANT_TYPES", types)?;
    m.add("GEMV_MAX_ROWS", quant::GEMV_MAX_ROWS)?;
    Ok(())
}
