//! The threads' share of an exact product over the file's blocks: rows of W split into tasks
//! over `cpu_attn::pool` (torch's OpenMP team).

#[cfg(target_arch = "x86_64")]
use crate::x86;
use crate::{scalar, Isa, Problem};

/// Rows of W per GEMV task: enough tasks to balance the threads, each long enough to stream.
/// (The GEMV runs them as `pool::for_each_streamed`: each thread's tasks one run of rows.)
pub(crate) fn gemv_task_rows(rows: usize, threads: usize) -> usize {
    rows.div_ceil(threads * 8).clamp(4, 64)
}

/// The GEMV of problems that share x (`matmul_segments`).
pub(crate) fn gemv_many(problems: &[Problem<'_>], isa: Isa, threads: usize) {
    let total: usize = problems.iter().map(|p| p.w.rows).sum();
    let step = gemv_task_rows(total, threads);
    // (problem, rows) of each task, the problems' rows in order
    let tasks: Vec<(usize, std::ops::Range<usize>)> = problems
        .iter()
        .enumerate()
        .flat_map(|(i, p)| {
            (0..p.w.rows)
                .step_by(step)
                .map(move |r| (i, r..(r + step).min(p.w.rows)))
        })
        .collect();
    cpu_attn::pool::for_each_streamed(tasks.len(), threads, &|t| {
        let (i, rows) = tasks[t].clone();
        let p = &problems[i];
        // SAFETY: `p` was checked in `matmul`, `isa` is available, and task `t` alone writes
        // columns `rows` of y.
        unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 | Isa::Avx2 | Isa::Avx2Vnni => x86::gemv_f32(p, rows, isa),
                _ => scalar::gemv_f32(p, rows),
            }
        }
    });
}

pub(crate) fn gemm(p: &Problem<'_>, isa: Isa, threads: usize) {
    let tiles = p.w.rows.div_ceil(TILE_ROWS);
    cpu_attn::pool::for_each(tiles, threads, &|t| {
        let rows = t * TILE_ROWS..((t + 1) * TILE_ROWS).min(p.w.rows);
        // SAFETY: as in `gemv`.
        unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 | Isa::Avx2 | Isa::Avx2Vnni => x86::gemm_f32(p, rows, isa),
                _ => scalar::gemv_f32(p, rows),
            }
        }
    });
}

/// Rows of W in one tile of the GEMM kernels (two 16-lane vectors of outputs).
pub(crate) const TILE_ROWS: usize = 32;
