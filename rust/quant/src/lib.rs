//! GGUF block-quantized weights on the CPU: dequantize, and `y = x W^T` without ever
//! materialising W in f32, in two layouts.
//!
//! **Panels** (`panel`, `panel_matmul_segments`; the default kernels): each weight repacked
//! once into panels of 16 rows, x rounded per 32 values to 16-bit (or 8-bit) integer levels,
//! integer dot products that advance 16 outputs each (`vpdpbusd`; `vpmaddubsw` on AVX2).
//!
//! **The file's blocks** (`matmul`, `matmul_segments`; the exact kernels): layout contract
//! (checked by `Weights::new` and `matmul`; the Python launcher checks dtypes and contiguity):
//! - `W` `[rows, cols]` is `rows` rows of `cols / block_len` blocks each, exactly as in a GGUF
//!   file (`format`), rows `row_stride` bytes apart (a column shard of a row-parallel layer
//!   is a window of whole blocks of each row, so `row_stride` may exceed a row's bytes).
//! - `x` `[n, cols]` f32 row-major; `y` `[n, ld_y]` f32, of which this writes columns
//!   `0..rows` of each row (so a merged layer's segments write their own column ranges).
//!
//! Exact kernels (`Kernel`): the product with the exact dequantized weights in f32.
//! - `Gemv`: the decode case. Rows of W are read once, each block decoded to f32 in registers
//!   and multiplied into all `n` rows of `x`.
//! - `GemmF32`: a tile of 32 rows of W dequantized once per call into f32 panels for an f32
//!   micro-kernel.
//!
//! Every kernel runs on AVX-512 (F, BW, VL and VNNI), AVX2 (with FMA and F16C; AVX-VNNI for
//! the panels where present) and portable code (`Isa`), chosen at run time or forced (tests
//! run every path the CPU has). Work is split by rows of W across threads of
//! `cpu_attn::pool` (torch's OpenMP team).

pub mod format;
pub mod panel;
mod panel_act;
mod panel_run;
mod run;
mod scalar;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::fmt;

pub use format::{decode_block, f16_to_f32, Group, QType};
pub use panel::{panel_bytes, repack, Panels, PANEL_ROWS};
pub use panel_act::Precision;
pub use panel_run::panel_matmul_segments;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantError(pub String);

impl fmt::Display for QuantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for QuantError {}

fn err<T>(msg: String) -> Result<T, QuantError> {
    Err(QuantError(msg))
}

/// An instruction set the kernels are compiled for. `Avx2Vnni` is AVX2 with AVX-VNNI (the
/// 256-bit `vpdpbusd`): the panel kernels use it, the others run their AVX2 code there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx2Vnni,
    Avx512,
}

impl Isa {
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx2Vnni, Isa::Avx512];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx2Vnni => "avx2vnni",
            Isa::Avx512 => "avx512",
        }
    }

    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|i| i.name() == name)
    }

    /// Whether this CPU has the features the kernels of `self` use (and `cpu_attn::isa_cap`
    /// allows them).
    pub fn is_available(self) -> bool {
        use cpu_attn::isa_cap;
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => isa_cap::avx2() && x86::has_avx2(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Vnni => isa_cap::avx_vnni() && x86::has_avx2_vnni(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => isa_cap::avx512() && x86::has_avx512(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The fastest instruction set this CPU has.
    pub fn best() -> Isa {
        [Isa::Avx512, Isa::Avx2Vnni, Isa::Avx2]
            .into_iter()
            .find(|i| i.is_available())
            .unwrap_or(Isa::Scalar)
    }
}

/// The exact kernels' loop structure (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    Gemv,
    GemmF32,
}

impl Kernel {
    pub const ALL: [Kernel; 2] = [Kernel::Gemv, Kernel::GemmF32];

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Gemv => "gemv",
            Kernel::GemmF32 => "gemm_f32",
        }
    }

    pub fn from_name(name: &str) -> Option<Kernel> {
        Kernel::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The measured choice for `n` rows of x: the f32 tiles dequantize (and transpose) each
    /// tile of W once per call, ~6 ms for a 4096x4096 weight on 2 cores whatever the rows of
    /// x, so the GEMV, which decodes W once per 8 rows, is faster up to ~32 rows (Q4_K
    /// 4096x4096, 2 threads: 8 rows 1.9 vs 6.6 ms, 16: 3.6 vs 6.9, 32: 7.1 vs 8.5, 64: 13.8
    /// vs 11.0; Q6_K and Q4_1 alike).
    pub fn auto(n: usize) -> Kernel {
        if n <= GEMV_MAX_ROWS {
            Kernel::Gemv
        } else {
            Kernel::GemmF32
        }
    }
}

/// The most rows of x `Kernel::auto` sends to the GEMV.
pub const GEMV_MAX_ROWS: usize = 32;

/// A quantized weight matrix borrowed from the file's bytes (see the module doc).
#[derive(Clone, Copy, Debug)]
pub struct Weights<'a> {
    pub qtype: QType,
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    data: &'a [u8],
}

impl<'a> Weights<'a> {
    pub fn new(
        qtype: QType,
        data: &'a [u8],
        rows: usize,
        cols: usize,
        row_stride: usize,
    ) -> Result<Self, QuantError> {
        let block = qtype.block_len();
        if cols == 0 || !cols.is_multiple_of(block) {
            return err(format!(
                "in_features={cols} is not a positive multiple of {}'s block of {block}",
                qtype.name()
            ));
        }
        let row_bytes = qtype.row_bytes(cols);
        if row_stride < row_bytes {
            return err(format!(
                "row stride {row_stride} is less than a row's {row_bytes} bytes"
            ));
        }
        let need = match rows {
            0 => Some(0),
            _ => (rows - 1)
                .checked_mul(row_stride)
                .and_then(|b| b.checked_add(row_bytes)),
        };
        match need {
            Some(need) if need <= data.len() => Ok(Weights {
                qtype,
                rows,
                cols,
                row_stride,
                data,
            }),
            _ => err(format!(
                "{rows} rows of {row_bytes} bytes, {row_stride} apart, need more than the \
                 {} bytes given",
                data.len()
            )),
        }
    }

    pub fn row_bytes(&self) -> usize {
        self.qtype.row_bytes(self.cols)
    }

    /// Row `r`'s blocks.
    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.data[r * self.row_stride..][..self.row_bytes()]
    }

    pub fn num_blocks(&self) -> usize {
        self.cols / self.qtype.block_len()
    }
}

/// How to run a call: the instruction set (which must be available), the kernel (`None`:
/// `Kernel::auto`) and the most threads.
#[derive(Clone, Copy, Debug)]
pub struct Run {
    pub isa: Isa,
    pub kernel: Option<Kernel>,
    pub threads: usize,
}

/// The output rows a kernel writes; each task writes its own rows of W's columns.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub *mut f32);

// SAFETY: tasks write disjoint columns of `y` (their own rows of W); see `matmul`.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// One call's operands, checked: `y[r * ld_y + o] = x[r] . W[o]`.
#[derive(Clone, Copy)]
pub(crate) struct Problem<'a> {
    pub w: Weights<'a>,
    pub x: &'a [f32],
    pub n: usize,
    pub y: OutPtr,
    pub ld_y: usize,
}

pub(crate) fn check_isa(isa: Isa) -> Result<(), QuantError> {
    if isa.is_available() {
        Ok(())
    } else {
        err(format!("this CPU lacks the {} instruction set", isa.name()))
    }
}

/// `y[:, :rows] = x W^T` (module doc). Returns the kernel that ran.
pub fn matmul(
    w: &Weights<'_>,
    x: &[f32],
    n: usize,
    y: &mut [f32],
    ld_y: usize,
    run: Run,
) -> Result<Kernel, QuantError> {
    matmul_segments(&[(*w, 0)], x, n, y, ld_y, run)
}

/// Checks x `[n, cols]` and that y (`y_len` values, rows `ld_y` apart) holds columns
/// `col..col + rows` of `n` rows.
pub(crate) fn check_xy(
    rows: usize,
    cols: usize,
    col: usize,
    x: &[f32],
    n: usize,
    y_len: usize,
    ld_y: usize,
) -> Result<(), QuantError> {
    if n.checked_mul(cols) != Some(x.len()) {
        return err(format!(
            "x has {} values, not n * in_features = {n} * {cols}",
            x.len(),
        ));
    }
    let width = col.checked_add(rows);
    let y_need = match n {
        0 => Some(0),
        _ => (n - 1)
            .checked_mul(ld_y)
            .and_then(|v| v.checked_add(width?)),
    };
    if width.is_none_or(|width| ld_y < width) || y_need.is_none_or(|need| y_len < need) {
        return err(format!(
            "y ({y_len} values, rows {ld_y} apart) cannot hold {n} rows of outputs {col}..{}",
            col.saturating_add(rows)
        ));
    }
    Ok(())
}

/// `y[:, col_s .. col_s + rows_s] = x W_s^T` for each segment `(W_s, col_s)` (one `cols`):
/// a merged layer's weights (q, k and v; gate and up), each in its own format, as one call.
/// The GEMV kernels round x once and spread all the segments' rows over the threads in one
/// go (one run of rows each), where a call per segment paid for each its own rounding, fork
/// and join, and ramp of the memory streams. Segments' columns must not overlap. Returns the
/// kernel that ran.
pub fn matmul_segments(
    segments: &[(Weights<'_>, usize)],
    x: &[f32],
    n: usize,
    y: &mut [f32],
    ld_y: usize,
    run: Run,
) -> Result<Kernel, QuantError> {
    check_isa(run.isa)?;
    let mut cols: Vec<(usize, usize)> = Vec::with_capacity(segments.len());
    for (w, col) in segments {
        if w.cols != segments[0].0.cols {
            return err(format!(
                "segments take {} and {} inputs; one call needs one in_features",
                segments[0].0.cols, w.cols
            ));
        }
        check_xy(w.rows, w.cols, *col, x, n, y.len(), ld_y)?;
        cols.push((*col, col + w.rows));
    }
    cols.sort_unstable();
    if cols.windows(2).any(|c| c[1].0 < c[0].1) {
        return err(format!("segments' output columns overlap: {cols:?}"));
    }
    let kernel = run.kernel.unwrap_or_else(|| Kernel::auto(n));
    let problems: Vec<Problem<'_>> = segments
        .iter()
        .filter(|(w, _)| w.rows > 0)
        .map(|(w, col)| Problem {
            w: *w,
            x,
            n,
            y: OutPtr(y.as_mut_ptr().wrapping_add(*col)), // inside y: `check_xy`
            ld_y,
        })
        .collect();
    if n == 0 || problems.is_empty() {
        return Ok(kernel);
    }
    let threads = run.threads.max(1);
    match kernel {
        Kernel::Gemv => run::gemv_many(&problems, run.isa, threads),
        Kernel::GemmF32 => {
            for p in &problems {
                run::gemm(p, run.isa, threads)
            }
        }
    }
    Ok(kernel)
}

/// `out[r * cols + c] = W[r, c]` for all rows, in f32 (rounded once from the exact value, as
/// llama.cpp and gguf-py do).
pub fn dequantize(
    w: &Weights<'_>,
    out: &mut [f32],
    isa: Isa,
    threads: usize,
) -> Result<(), QuantError> {
    check_isa(isa)?;
    if w.rows.checked_mul(w.cols) != Some(out.len()) {
        return err(format!(
            "out has {} values, not rows * in_features = {} * {}",
            out.len(),
            w.rows,
            w.cols
        ));
    }
    let out = &OutPtr(out.as_mut_ptr());
    let step = run::gemv_task_rows(w.rows, threads.max(1));
    cpu_attn::pool::for_each(w.rows.div_ceil(step), threads.max(1), &|t| {
        for r in t * step..((t + 1) * step).min(w.rows) {
            // SAFETY: row r of `out` (checked length) is written by this task alone.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(r * w.cols), w.cols) };
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 | Isa::Avx2 | Isa::Avx2Vnni => unsafe {
                    x86::dequantize_row(w, r, dst)
                },
                _ => scalar::dequantize_row(w, r, dst),
            }
        }
    });
    Ok(())
}
