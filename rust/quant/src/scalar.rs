//! The portable kernels: the fallback where the CPU has no AVX2, and the plain statement of
//! what the SIMD ones compute (the f32 kernels multiply by the exact dequantized weights; the
//! int8 ones sum `scale_w * scale_x * (levels . levels) + offset_w * sum(x)` per 16 weights).

use std::ops::Range;

use crate::act::Acts;
use crate::format::{decode_block, Group};
use crate::{Problem, Weights};

/// Decode row `r` of `w` into groups (`out` holds `cols / 32`).
fn row_groups(w: &Weights<'_>, r: usize, out: &mut [Group]) {
    let (qtype, per_block) = (w.qtype, w.qtype.block_len() / 32);
    let row = w.row(r);
    for (b, groups) in out.chunks_exact_mut(per_block).enumerate() {
        decode_block(qtype, &row[b * qtype.block_bytes()..], groups);
    }
}

pub(crate) fn dequantize_row(w: &Weights<'_>, r: usize, out: &mut [f32]) {
    let mut groups = vec![Group::default(); w.cols / 32];
    row_groups(w, r, &mut groups);
    let signed = w.qtype.is_signed();
    for (group, dst) in groups.iter().zip(out.chunks_exact_mut(32)) {
        for (i, d) in dst.iter_mut().enumerate() {
            *d = group.weight(i, signed);
        }
    }
}

/// SAFETY: `p` checked by `matmul`; no other thread writes columns `rows` of y.
pub(crate) unsafe fn gemv_f32(p: &Problem<'_>, rows: Range<usize>) {
    let cols = p.w.cols;
    let mut weights = vec![0f32; cols];
    for o in rows {
        dequantize_row(&p.w, o, &mut weights);
        for r in 0..p.n {
            let x = &p.x[r * cols..][..cols];
            let dot: f32 = weights.iter().zip(x).map(|(w, x)| w * x).sum();
            *p.y.0.add(r * p.ld_y + o) = dot;
        }
    }
}

/// SAFETY: as `gemv_f32`; `acts` quantizes `p.x`.
pub(crate) unsafe fn gemv_int8(p: &Problem<'_>, acts: &Acts, rows: Range<usize>) {
    let cols = p.w.cols;
    let signed = p.w.qtype.is_signed();
    let mut groups = vec![Group::default(); cols / 32];
    for o in rows {
        row_groups(&p.w, o, &mut groups);
        for r in 0..p.n {
            let xq = &acts.q[r * cols..][..cols];
            let mut acc = 0f32;
            for (g, group) in groups.iter().enumerate() {
                let x_scale = acts.scale[r * cols / 32 + g];
                for h in 0..2 {
                    let mut dot = 0i32;
                    for i in 16 * h..16 * h + 16 {
                        let q = if signed {
                            i32::from(group.q[i] as i8)
                        } else {
                            i32::from(group.q[i])
                        };
                        dot += q * i32::from(xq[32 * g + i]);
                    }
                    let sum = acts.sum16[r * cols / 16 + 2 * g + h];
                    acc += group.scale[h] * x_scale * dot as f32 + group.offset[h] * sum;
                }
            }
            *p.y.0.add(r * p.ld_y + o) = acc;
        }
    }
}
