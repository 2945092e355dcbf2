//! `panel_matmul`: `y = x W^T` over weights in panels (`crate::panel`), x rounded once per
//! call (`panel_act`); the panels split over the threads in runs, every row of x done in
//! each; and the portable kernel, the plain statement of what the SIMD ones compute:
//!
//! per group of 32 columns, `acc += f32(sum_i q_i xq_i - zero * sum_i xq_i) * (scale * sx)`,
//! then for a format with a free offset `acc += offset * (sx * sum_i xq_i)` (Q6_K: the same
//! per half of 16 columns with its own scale), `q` the weight's unsigned levels, `xq` the
//! activation's and `sx` its scale. The integer sums are exact; the f32 steps round in that
//! order, so the kernels agree to the last bit but for the order in which lanes of a sum meet.

use crate::panel::{levels, scales, Panels, PANEL_ROWS};
use crate::panel_act::{PanelActs, Precision};
#[cfg(target_arch = "x86_64")]
use crate::x86;
use crate::{err, Isa, OutPtr, QuantError};

/// `y[:, col_s .. col_s + rows_s] = x W_s^T` for each segment `(W_s, col_s)` of one `cols`
/// (a merged layer's q, k and v; gate and up), x rounded to `precision` once.
#[allow(clippy::too_many_arguments)]
pub fn panel_matmul_segments(
    segments: &[(Panels<'_>, usize)],
    x: &[f32],
    n: usize,
    y: &mut [f32],
    ld_y: usize,
    precision: Precision,
    isa: Isa,
    threads: usize,
) -> Result<(), QuantError> {
    crate::check_isa(isa)?;
    let Some((first, _)) = segments.first() else {
        return Ok(());
    };
    let cols = first.cols;
    let mut spans: Vec<(usize, usize)> = Vec::with_capacity(segments.len());
    for (w, col) in segments {
        if w.cols != cols {
            return err(format!(
                "segments take {cols} and {} inputs; one call needs one in_features",
                w.cols
            ));
        }
        crate::check_xy(w.rows, cols, *col, x, n, y.len(), ld_y)?;
        spans.push((*col, col + w.rows));
    }
    spans.sort_unstable();
    if spans.windows(2).any(|c| c[1].0 < c[0].1) {
        return err(format!("segments' output columns overlap: {spans:?}"));
    }
    if n == 0 {
        return Ok(());
    }
    let acts = PanelActs::quantize(x, n, cols, precision);
    let threads = threads.max(1);
    let total: usize = segments.iter().map(|(w, _)| w.num_panels()).sum();
    let step = total.div_ceil(threads * 8).clamp(1, 16);
    let tasks: Vec<(usize, std::ops::Range<usize>)> = segments
        .iter()
        .enumerate()
        .flat_map(|(s, (w, _))| {
            let num = w.num_panels();
            (0..num)
                .step_by(step)
                .map(move |p| (s, p..(p + step).min(num)))
        })
        .collect();
    let out = OutPtr(y.as_mut_ptr());
    cpu_attn::pool::for_each_streamed(tasks.len(), threads, &|t| {
        let (s, panels) = tasks[t].clone();
        let (w, col) = &segments[s];
        let out = &out;
        // SAFETY: checked above (`check_xy`: y holds columns col..col + rows of n rows); task
        // t alone writes these panels' columns; `isa` is available.
        unsafe {
            let y = out.0.add(*col);
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 | Isa::Avx2 | Isa::Avx2Vnni => {
                    x86::panel_task(w, &acts, panels, n, y, ld_y, isa)
                }
                _ => panel_portable(w, &acts, panels, n, y, ld_y),
            }
        }
    });
    Ok(())
}

/// The portable kernel (module doc).
/// SAFETY: as `x86::panel_task`.
unsafe fn panel_portable(
    w: &Panels<'_>,
    a: &PanelActs,
    panels: std::ops::Range<usize>,
    n: usize,
    y: *mut f32,
    ld_y: usize,
) {
    let (qtype, groups) = (w.qtype, w.cols / 32);
    let zero = qtype.zero_point();
    for p in panels {
        for r in 0..w.panel_rows(p) {
            for row in 0..n {
                let mut acc = 0f32;
                for b in 0..w.num_blocks() {
                    let blk = w.block(p, b);
                    for g in 0..qtype.groups() {
                        let (q, (scale, min)) =
                            (levels(qtype, blk, g, r), scales(qtype, blk, g, r));
                        let gi = b * qtype.groups() + g;
                        let at = row * groups + gi;
                        let sx = a.scale[at];
                        let mut sums = [0i32; 2];
                        for (i, &level) in q.iter().enumerate() {
                            sums[i / 16] += i32::from(level) * a.level(row, 32 * gi + i);
                        }
                        let qsum = [a.qsum[2 * at], a.qsum[2 * at + 1]];
                        if qtype == crate::QType::Q6K {
                            for h in 0..2 {
                                let i = (sums[h] - zero * qsum[h]) as f32;
                                acc = i.mul_add(scale[h] * sx, acc);
                            }
                            continue;
                        }
                        let i = (sums[0] + sums[1] - zero * (qsum[0] + qsum[1])) as f32;
                        acc = i.mul_add(scale[0] * sx, acc);
                        if qtype.has_min() {
                            acc = min.mul_add(a.xsum[at], acc);
                        }
                    }
                }
                *y.add(row * ld_y + p * PANEL_ROWS + r) = acc;
            }
        }
    }
}
