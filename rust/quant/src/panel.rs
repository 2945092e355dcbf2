//! Weights repacked into panels of 16 rows: the layout of the panel kernels (`panel_matmul`).
//!
//! The file's layout keeps each row's blocks together, so a kernel reads one row at a time
//! and reduces 32 products to one output with a horizontal sum per block. Here the rows come
//! in panels of `PANEL_ROWS` = 16, and a panel holds each block of its 16 rows together, its
//! levels arranged so that one 64-byte vector holds **4 consecutive levels of each of the 16
//! rows** (row r in dword lane r). One integer dot product (`vpdpbusd`) of such a vector with
//! 4 activation bytes broadcast to every lane then advances all 16 outputs by 4 products each:
//! a 32-column group of a panel is 8 of them, and a row's result never leaves its lane (no
//! horizontal sums, one 16-wide store per panel).
//!
//! A panel block (`QType::panel_block_bytes`, the bytes of 16 file blocks, or 2.3-2.8% more
//! for Q4_K / Q5_K) is the block's groups of 32 columns, each `group_bytes`, then the scales:
//!
//! | format | per group | then |
//! |---|---|---|
//! | Q4_0, Q5_0, Q8_0 | levels (+ fifth bits) | `d`: 16 f16 |
//! | Q4_1, Q5_1 | levels (+ fifth bits) | `d`, `m`: 16 f16 each |
//! | Q4_K, Q5_K | 8 x levels (+ fifth bits) | `sc`, `mn`: 8 x 16 u8; `d`, `dmin`: 16 f16 each |
//! | Q6_K | 8 x levels + sixth and fifth bits | `sc`: 16 x 16 i8; `d`: 16 f16 |
//!
//! Levels are unsigned: Q8_0's are stored plus 128, and every symmetric format's zero point
//! (`zero_point`: 8, 16, 128, 32) is taken off in integers, with the activations' sum. In a
//! group, chunk `c` (0..8) is columns `4c .. 4c + 4`, byte `4r + i` of it column `4c + i` of row r:
//! - 4-bit low parts (every format but Q8_0): 4 vectors; vector `j`'s low nibbles are chunk j,
//!   its high nibbles chunk `j + 4`.
//! - fifth bits (Q5_0, Q5_1, Q5_K): one vector; bit c of byte `4r + i` is chunk c's.
//! - Q6_K's bits 4 and 5: 2 vectors; bits `2k, 2k + 1` of vector h's byte are chunk `4h + k`'s.
//! - Q8_0: 8 vectors, vector c is chunk c.
//!
//! Rows past the weight's last (the last panel's padding) are zeros: scale 0, output unused.

use crate::format::{k4_scale_min, Group, QType};
use crate::{err, QuantError, Weights};

/// Rows per panel: the 16 f32 (dword) lanes of an AVX-512 vector, or two AVX2 ones.
pub const PANEL_ROWS: usize = 16;

impl QType {
    /// 32-column groups per block.
    pub const fn groups(self) -> usize {
        self.block_len() / 32
    }

    /// The levels of one group of a panel (16 rows x 32 columns), fifth and sixth bits
    /// included.
    pub const fn group_bytes(self) -> usize {
        match self {
            QType::Q8_0 => 512,
            QType::Q4_0 | QType::Q4_1 | QType::Q4K => 256,
            QType::Q5_0 | QType::Q5_1 | QType::Q5K => 320,
            QType::Q6K => 384,
        }
    }

    /// The scales after a panel block's groups.
    pub const fn panel_scale_bytes(self) -> usize {
        match self {
            QType::Q8_0 | QType::Q4_0 | QType::Q5_0 => 32,
            QType::Q4_1 | QType::Q5_1 => 64,
            QType::Q4K | QType::Q5K => 320,
            QType::Q6K => 288,
        }
    }

    /// Bytes of one panel block: 16 rows x one file block.
    pub const fn panel_block_bytes(self) -> usize {
        self.groups() * self.group_bytes() + self.panel_scale_bytes()
    }

    /// The level that means 0 in a symmetric format (`w = d * (q - zero)`), else 0.
    pub const fn zero_point(self) -> i32 {
        match self {
            QType::Q8_0 => 128,
            QType::Q4_0 => 8,
            QType::Q5_0 => 16,
            QType::Q6K => 32,
            _ => 0,
        }
    }

    /// Whether a group's weights carry a free offset (`w = scale * q + offset`), which the
    /// kernels add as `offset * sum(x)`.
    pub const fn has_min(self) -> bool {
        matches!(self, QType::Q4_1 | QType::Q5_1 | QType::Q4K | QType::Q5K)
    }
}

/// Bytes of `rows` x `cols` weights in panels (`cols` a multiple of the block).
pub fn panel_bytes(qtype: QType, rows: usize, cols: usize) -> usize {
    rows.div_ceil(PANEL_ROWS) * (cols / qtype.block_len()) * qtype.panel_block_bytes()
}

/// A weight in panels, borrowed and checked (module doc).
#[derive(Clone, Copy, Debug)]
pub struct Panels<'a> {
    pub qtype: QType,
    pub rows: usize,
    pub cols: usize,
    data: &'a [u8],
}

impl<'a> Panels<'a> {
    pub fn new(qtype: QType, data: &'a [u8], rows: usize, cols: usize) -> Result<Self, QuantError> {
        let block = qtype.block_len();
        if cols == 0 || !cols.is_multiple_of(block) {
            return err(format!(
                "in_features={cols} is not a positive multiple of {}'s block of {block}",
                qtype.name()
            ));
        }
        let need = panel_bytes(qtype, rows, cols);
        if data.len() != need {
            return err(format!(
                "{rows} x {cols} {} weights in panels take {need} bytes, got {}",
                qtype.name(),
                data.len()
            ));
        }
        Ok(Panels {
            qtype,
            rows,
            cols,
            data,
        })
    }

    pub fn num_panels(&self) -> usize {
        self.rows.div_ceil(PANEL_ROWS)
    }

    pub fn num_blocks(&self) -> usize {
        self.cols / self.qtype.block_len()
    }

    /// Panel `p`'s block `b`.
    pub fn block(&self, p: usize, b: usize) -> &'a [u8] {
        let size = self.qtype.panel_block_bytes();
        &self.data[(p * self.num_blocks() + b) * size..][..size]
    }

    /// Rows of panel `p` that are the weight's (16 but in the last panel).
    pub fn panel_rows(&self, p: usize) -> usize {
        (self.rows - p * PANEL_ROWS).min(PANEL_ROWS)
    }
}

/// Copy `w`'s blocks into panels (`out` holds `panel_bytes`), on `threads` threads.
pub fn repack(w: &Weights<'_>, out: &mut [u8], threads: usize) -> Result<(), QuantError> {
    let need = panel_bytes(w.qtype, w.rows, w.cols);
    if out.len() != need {
        return err(format!(
            "out has {} bytes; {} x {} {} weights in panels take {need}",
            out.len(),
            w.rows,
            w.cols,
            w.qtype.name()
        ));
    }
    let panel = w.num_blocks() * w.qtype.panel_block_bytes();
    let base = out.as_mut_ptr() as usize; // an address: the tasks share it
    let num_panels = w.rows.div_ceil(PANEL_ROWS);
    cpu_attn::pool::for_each(num_panels, threads.max(1), &|p| {
        // SAFETY: panel p's bytes (inside `out`: checked length) are written by this task alone.
        let dst =
            unsafe { std::slice::from_raw_parts_mut((base as *mut u8).add(p * panel), panel) };
        repack_panel(w, p, dst);
    });
    Ok(())
}

fn repack_panel(w: &Weights<'_>, p: usize, dst: &mut [u8]) {
    let (qtype, size) = (w.qtype, w.qtype.panel_block_bytes());
    dst.fill(0);
    for r in 0..PANEL_ROWS.min(w.rows - p * PANEL_ROWS) {
        let row = w.row(p * PANEL_ROWS + r);
        for (b, blk) in dst.chunks_exact_mut(size).enumerate() {
            let src = &row[b * qtype.block_bytes()..][..qtype.block_bytes()];
            put_levels(qtype, blk, r, src);
            put_scales(
                qtype,
                &mut blk[qtype.groups() * qtype.group_bytes()..],
                r,
                src,
            );
        }
    }
}

/// Row r's levels of the file block `src` into its lane of each group of the panel block
/// `blk` (module doc), byte by byte from the file's bit layout (`format::decode_block`'s,
/// which the tests hold this to): the 4-bit parts are the file's bytes regrouped, 4 at a
/// time, so repacking runs at memory speed.
fn put_levels(qtype: QType, blk: &mut [u8], r: usize, src: &[u8]) {
    let at = 4 * r;
    let word = |bytes: &[u8], i: usize| {
        u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]])
    };
    match qtype {
        QType::Q8_0 => {
            for c in 0..8 {
                let v = word(src, 2 + 4 * c) ^ 0x8080_8080; // i8 -> i8 + 128 as u8
                blk[64 * c + at..][..4].copy_from_slice(&v.to_le_bytes());
            }
        }
        QType::Q4_0 | QType::Q4_1 | QType::Q5_0 | QType::Q5_1 => {
            let qs = match qtype {
                QType::Q4_0 => 2,
                QType::Q4_1 => 4,
                QType::Q5_0 => 6,
                _ => 8,
            };
            for m in 0..4 {
                blk[64 * m + at..][..4].copy_from_slice(&src[qs + 4 * m..qs + 4 * m + 4]);
            }
            if matches!(qtype, QType::Q5_0 | QType::Q5_1) {
                let qh = word(src, qs - 4);
                for i in 0..4 {
                    blk[256 + at + i] =
                        (0..8).map(|c| (((qh >> (4 * c + i)) & 1) << c) as u8).sum();
                }
            }
        }
        QType::Q4K | QType::Q5K => {
            let (qs, gb) = if qtype == QType::Q5K {
                (48, 320)
            } else {
                (16, 256)
            };
            for j in 0..8 {
                let group = &mut blk[gb * j..];
                nibbles(group, at, &src[qs + 32 * (j / 2)..][..32], j % 2 == 1);
                if qtype == QType::Q5K {
                    let qh = &src[16..48];
                    for i in 0..4 {
                        group[256 + at + i] = (0..8).map(|c| ((qh[4 * c + i] >> j) & 1) << c).sum();
                    }
                }
            }
        }
        QType::Q6K => {
            let (ql, qh) = (&src[..128], &src[128..192]);
            for g in 0..8 {
                let (h, s) = (g / 4, g % 4);
                let group = &mut blk[384 * g..];
                nibbles(group, at, &ql[h * 64 + (s % 2) * 32..][..32], s / 2 == 1);
                for (v, bits) in group[256..384].chunks_exact_mut(64).enumerate() {
                    for i in 0..4 {
                        bits[at + i] = (0..4)
                            .map(|k| ((qh[h * 32 + 4 * (4 * v + k) + i] >> (2 * s)) & 3) << (2 * k))
                            .sum();
                    }
                }
            }
        }
    }
}

/// A 32-level group's 4-bit parts from 32 file bytes holding level l in byte l's low nibble
/// (or high, `high`): the panel's byte `64 m + at + i` takes levels `4m + i` (low nibble) and
/// `16 + 4m + i` (high nibble).
fn nibbles(group: &mut [u8], at: usize, bytes: &[u8], high: bool) {
    for m in 0..4 {
        let a = u32::from_le_bytes(bytes[4 * m..4 * m + 4].try_into().unwrap_or([0; 4]));
        let b = u32::from_le_bytes(bytes[16 + 4 * m..20 + 4 * m].try_into().unwrap_or([0; 4]));
        let v = if high {
            ((a >> 4) & 0x0f0f_0f0f) | (b & 0xf0f0_f0f0)
        } else {
            (a & 0x0f0f_0f0f) | ((b & 0x0f0f_0f0f) << 4)
        };
        group[64 * m + at..][..4].copy_from_slice(&v.to_le_bytes());
    }
}

/// Row r's scales from its file block `src` into the panel block's scale area `dst`.
fn put_scales(qtype: QType, dst: &mut [u8], r: usize, src: &[u8]) {
    let half = |dst: &mut [u8], field: usize, at: usize| {
        dst[32 * field + 2 * r..][..2].copy_from_slice(&src[at..at + 2]);
    };
    match qtype {
        QType::Q8_0 | QType::Q4_0 | QType::Q5_0 => half(dst, 0, 0),
        QType::Q4_1 | QType::Q5_1 => {
            half(dst, 0, 0);
            half(dst, 1, 2);
        }
        QType::Q4K | QType::Q5K => {
            for j in 0..8 {
                let (sc, mn) = k4_scale_min(&src[4..16], j);
                dst[16 * j + r] = sc;
                dst[128 + 16 * j + r] = mn;
            }
            let tail = &mut dst[256..];
            half(tail, 0, 0);
            half(tail, 1, 2);
        }
        QType::Q6K => {
            for h in 0..16 {
                dst[16 * h + r] = src[192 + h];
            }
            half(&mut dst[256..], 0, 208);
        }
    }
}

/// Row `r`'s levels of group `g` of a panel block, unsigned as stored (Q8_0: plus 128).
pub(crate) fn levels(qtype: QType, blk: &[u8], g: usize, r: usize) -> [u8; 32] {
    let group = &blk[g * qtype.group_bytes()..][..qtype.group_bytes()];
    let mut q = [0u8; 32];
    for c in 0..8 {
        for i in 0..4 {
            let at = 4 * r + i;
            q[4 * c + i] = match qtype {
                QType::Q8_0 => group[64 * c + at],
                _ => {
                    let low = (group[64 * (c % 4) + at] >> (4 * (c / 4))) & 0xf;
                    let high = match qtype {
                        QType::Q5_0 | QType::Q5_1 | QType::Q5K => ((group[256 + at] >> c) & 1) << 4,
                        QType::Q6K => ((group[256 + 64 * (c / 4) + at] >> (2 * (c % 4))) & 3) << 4,
                        _ => 0,
                    };
                    low | high
                }
            };
        }
    }
    q
}

/// Row `r`'s scales of group `g`: the scale of each 16 columns and the free offset (0 for a
/// symmetric format, whose offset is `-zero_point * scale`).
pub(crate) fn scales(qtype: QType, blk: &[u8], g: usize, r: usize) -> ([f32; 2], f32) {
    let tail = &blk[qtype.groups() * qtype.group_bytes()..];
    let half = |area: &[u8], field: usize| {
        crate::format::f16_to_f32(u16::from_le_bytes([
            area[32 * field + 2 * r],
            area[32 * field + 2 * r + 1],
        ]))
    };
    match qtype {
        QType::Q8_0 | QType::Q4_0 | QType::Q5_0 => ([half(tail, 0); 2], 0.0),
        QType::Q4_1 | QType::Q5_1 => ([half(tail, 0); 2], half(tail, 1)),
        QType::Q4K | QType::Q5K => {
            let (sc, mn) = (tail[16 * g + r], tail[128 + 16 * g + r]);
            let (d, dmin) = (half(&tail[256..], 0), half(&tail[256..], 1));
            ([d * f32::from(sc); 2], -(dmin * f32::from(mn)))
        }
        QType::Q6K => {
            let d = half(&tail[256..], 0);
            let sc = |h: usize| d * f32::from(tail[16 * h + r] as i8);
            ([sc(2 * g), sc(2 * g + 1)], 0.0)
        }
    }
}

/// Row `r`'s group `g` in the portable decoder's form (`format::decode_block`'s, which the
/// tests hold it to).
pub fn group(qtype: QType, blk: &[u8], g: usize, r: usize) -> Group {
    let mut q = levels(qtype, blk, g, r);
    let (scale, min) = scales(qtype, blk, g, r);
    let zero = qtype.zero_point() as f32;
    if qtype == QType::Q8_0 {
        q.iter_mut().for_each(|v| *v ^= 0x80);
    }
    let offset = if qtype.has_min() || qtype == QType::Q8_0 {
        [min; 2]
    } else {
        [-zero * scale[0], -zero * scale[1]]
    };
    Group { q, scale, offset }
}

/// `out [rows, cols]` = the weights of `w` in f32 (each rounded once, as `decode_block`'s).
pub fn dequantize(w: &Panels<'_>, out: &mut [f32]) -> Result<(), QuantError> {
    if w.rows.checked_mul(w.cols) != Some(out.len()) {
        return err(format!(
            "out has {} values, not rows * in_features = {} * {}",
            out.len(),
            w.rows,
            w.cols
        ));
    }
    let (qtype, signed) = (w.qtype, w.qtype.is_signed());
    for (o, dst) in out.chunks_exact_mut(w.cols).enumerate() {
        let (p, r) = (o / PANEL_ROWS, o % PANEL_ROWS);
        for (gi, d) in dst.chunks_exact_mut(32).enumerate() {
            let (b, g) = (gi / qtype.groups(), gi % qtype.groups());
            let group = group(qtype, w.block(p, b), g, r);
            for (i, v) in d.iter_mut().enumerate() {
                *v = group.weight(i, signed);
            }
        }
    }
    Ok(())
}
