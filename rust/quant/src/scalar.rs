//! The portable exact kernel: the fallback where the CPU has no AVX2, and the plain statement
//! of what the SIMD ones compute (the exact dequantized weights times x, in f32).

use std::ops::Range;

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
