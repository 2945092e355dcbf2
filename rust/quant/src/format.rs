//! The GGUF block formats, byte for byte as llama.cpp writes them, and their portable
//! decoders into the kernels' common form (`Group`).
//!
//! A row of `cols` weights is `cols / block_len` blocks back to back. The 32-weight types
//! (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) carry an f16 scale `d` (and an f16 min `m` for the `_1`
//! types); the k-quants (Q4_K, Q5_K, Q6_K) are 256-weight super-blocks of 8 (16 for Q6_K)
//! sub-blocks, each with its own small integer scale under the super-block's f16 `d`.
//!
//! Every format decodes to groups of 32 weights `w[i] = scale[i / 16] * q[i] + offset[i / 16]`
//! with `q` unsigned (Q8_0: signed, offset 0): one shape the SIMD consumers take whatever the
//! file's format. Two halves because Q6_K scales every 16 weights.

/// One of the block formats (GGML type ids in `ggml_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QType {
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q4K,
    Q5K,
    Q6K,
}

impl QType {
    pub const ALL: [QType; 8] = [
        QType::Q8_0,
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q4K,
        QType::Q5K,
        QType::Q6K,
    ];

    /// The name GGUF and llama.cpp use (`"Q4_K"`).
    pub const fn name(self) -> &'static str {
        match self {
            QType::Q8_0 => "Q8_0",
            QType::Q4_0 => "Q4_0",
            QType::Q4_1 => "Q4_1",
            QType::Q5_0 => "Q5_0",
            QType::Q5_1 => "Q5_1",
            QType::Q4K => "Q4_K",
            QType::Q5K => "Q5_K",
            QType::Q6K => "Q6_K",
        }
    }

    pub fn from_name(name: &str) -> Option<QType> {
        QType::ALL.into_iter().find(|t| t.name() == name)
    }

    /// GGML's `ggml_type` id of the format.
    pub const fn ggml_type(self) -> u32 {
        match self {
            QType::Q4_0 => 2,
            QType::Q4_1 => 3,
            QType::Q5_0 => 6,
            QType::Q5_1 => 7,
            QType::Q8_0 => 8,
            QType::Q4K => 12,
            QType::Q5K => 13,
            QType::Q6K => 14,
        }
    }

    /// Weights per block: 32, or 256 for the k-quants.
    pub const fn block_len(self) -> usize {
        match self {
            QType::Q4K | QType::Q5K | QType::Q6K => 256,
            _ => 32,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            QType::Q8_0 => 34,
            QType::Q4_0 => 18,
            QType::Q4_1 => 20,
            QType::Q5_0 => 22,
            QType::Q5_1 => 24,
            QType::Q4K => 144,
            QType::Q5K => 176,
            QType::Q6K => 210,
        }
    }

    /// Whether `Group::q` holds signed bytes (Q8_0) rather than unsigned levels.
    pub const fn is_signed(self) -> bool {
        matches!(self, QType::Q8_0)
    }

    /// Bytes of one row of `cols` weights (`cols` a multiple of `block_len`).
    pub const fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_len() * self.block_bytes()
    }
}

/// 32 consecutive weights: `w[i] = scale[i / 16] * q[i] + offset[i / 16]`, `q` read as `u8`,
/// or as `i8` for a signed format (whose offset is 0).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Group {
    pub q: [u8; 32],
    pub scale: [f32; 2],
    pub offset: [f32; 2],
}

impl Group {
    fn uniform(q: [u8; 32], scale: f32, offset: f32) -> Group {
        Group {
            q,
            scale: [scale; 2],
            offset: [offset; 2],
        }
    }

    /// The weight `i` as f32, rounded once from the exact `scale * q + offset` (so equal to
    /// llama.cpp's and gguf-py's dequantization, which round once too).
    #[inline(always)]
    pub fn weight(&self, i: usize, signed: bool) -> f32 {
        let q = if signed {
            f64::from(self.q[i] as i8)
        } else {
            f64::from(self.q[i])
        };
        (f64::from(self.scale[i / 16]) * q + f64::from(self.offset[i / 16])) as f32
    }
}

/// IEEE half to f32 (exact; subnormals, infinities and NaN included).
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match exp {
        0 => {
            let magnitude = man as f32 * (1.0 / 16_777_216.0); // man * 2^-24, exact
            return f32::from_bits(sign | magnitude.to_bits());
        }
        31 => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

#[inline(always)]
pub(crate) fn half(block: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([block[at], block[at + 1]]))
}

/// Q4_K / Q5_K: the 6-bit scale and min of sub-block `j` from the 12 packed scale bytes.
#[inline(always)]
pub(crate) fn k4_scale_min(scales: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0xf) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    }
}

/// The 32 levels of a 32-weight block with 4 low bits in `qs` (16 bytes: weight i's in the
/// low nibble of byte i, weight i + 16's in the high one) and a fifth bit from `qh`.
fn levels_32(qs: &[u8], qh: u32) -> [u8; 32] {
    let mut q = [0u8; 32];
    for i in 0..16 {
        q[i] = (qs[i] & 0xf) | ((((qh >> i) & 1) as u8) << 4);
        q[i + 16] = (qs[i] >> 4) | ((((qh >> (i + 16)) & 1) as u8) << 4);
    }
    q
}

/// Decode one block (`qtype.block_bytes()` bytes) into its `block_len / 32` groups.
pub fn decode_block(qtype: QType, block: &[u8], out: &mut [Group]) {
    let block = &block[..qtype.block_bytes()];
    match qtype {
        QType::Q8_0 => {
            let mut q = [0u8; 32];
            q.copy_from_slice(&block[2..34]);
            out[0] = Group::uniform(q, half(block, 0), 0.0);
        }
        QType::Q4_0 | QType::Q4_1 => {
            let d = half(block, 0);
            let (offset, qs) = if qtype == QType::Q4_0 {
                (-8.0 * d, &block[2..18])
            } else {
                (half(block, 2), &block[4..20])
            };
            out[0] = Group::uniform(levels_32(qs, 0), d, offset);
        }
        QType::Q5_0 | QType::Q5_1 => {
            let d = half(block, 0);
            let (offset, at) = if qtype == QType::Q5_0 {
                (-16.0 * d, 2)
            } else {
                (half(block, 2), 4)
            };
            let qh = u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
            out[0] = Group::uniform(levels_32(&block[at + 4..at + 20], qh), d, offset);
        }
        QType::Q4K | QType::Q5K => {
            let (d, dmin) = (half(block, 0), half(block, 2));
            let scales = &block[4..16];
            let (qh, qs) = if qtype == QType::Q5K {
                (Some(&block[16..48]), &block[48..176])
            } else {
                (None, &block[16..144])
            };
            for (j, group) in out[..8].iter_mut().enumerate() {
                let (sc, mn) = k4_scale_min(scales, j);
                let chunk = &qs[j / 2 * 32..j / 2 * 32 + 32];
                let mut q = [0u8; 32];
                for l in 0..32 {
                    let low = (chunk[l] >> (4 * (j % 2))) & 0xf;
                    let high = qh.map_or(0, |qh| ((qh[l] >> j) & 1) << 4);
                    q[l] = low | high;
                }
                *group = Group::uniform(q, d * f32::from(sc), -(dmin * f32::from(mn)));
            }
        }
        QType::Q6K => {
            let (ql, qh, scales) = (&block[..128], &block[128..192], &block[192..208]);
            let d = half(block, 208);
            for (g, group) in out[..8].iter_mut().enumerate() {
                let (h, s) = (g / 4, g % 4);
                let low = &ql[h * 64 + (s % 2) * 32..][..32];
                let high = &qh[h * 32..][..32];
                let mut q = [0u8; 32];
                for l in 0..32 {
                    q[l] = ((low[l] >> (4 * (s / 2))) & 0xf) | (((high[l] >> (2 * s)) & 3) << 4);
                }
                let scale = [
                    d * f32::from(scales[2 * g] as i8),
                    d * f32::from(scales[2 * g + 1] as i8),
                ];
                *group = Group {
                    q,
                    scale,
                    offset: [-32.0 * scale[0], -32.0 * scale[1]],
                };
            }
        }
    }
}
