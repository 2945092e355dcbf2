//! The formats: f16 conversion, hand-built blocks, and the SIMD decoders equal to the
//! portable ones bit for bit.

use super::{random_weights, Rng};
use crate::format::{decode_block, f16_to_f32, k4_scale_min, Group, QType};
use crate::{dequantize, Isa, Weights};

#[test]
fn f16_matches_known_values() {
    assert_eq!(f16_to_f32(0x3c00), 1.0);
    assert_eq!(f16_to_f32(0xc000), -2.0);
    assert_eq!(f16_to_f32(0x7bff), 65504.0);
    assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
    assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
    assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
    assert!(f16_to_f32(0x7e00).is_nan());
}

#[cfg(target_arch = "x86_64")]
#[test]
fn f16_matches_the_hardware_conversion_everywhere() {
    if !std::arch::is_x86_feature_detected!("f16c") {
        return;
    }
    for h in 0..=u16::MAX {
        // SAFETY: F16C checked above.
        let hw = unsafe {
            use std::arch::x86_64::*;
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
        };
        let sw = f16_to_f32(h);
        assert!(
            hw.to_bits() == sw.to_bits() || (hw.is_nan() && sw.is_nan()),
            "{h:#x}"
        );
    }
}

#[test]
fn q4_0_block_by_hand() {
    // d = 0.5; byte i holds level i % 16 low and 15 - i % 16 high.
    let mut block = vec![0x00, 0x38];
    block.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
    let mut g = [Group::default()];
    decode_block(QType::Q4_0, &block, &mut g);
    for i in 0..16 {
        assert_eq!(g[0].weight(i, false), 0.5 * (i as f32 - 8.0));
        assert_eq!(g[0].weight(i + 16, false), 0.5 * (7.0 - i as f32));
    }
}

#[test]
fn q5_0_fifth_bit_by_hand() {
    // d = 1; all low nibbles 0; qh sets the fifth bit of weights 1 and 31 only.
    let mut block = vec![0x00, 0x3c];
    block.extend(((1u32 << 1) | (1u32 << 31)).to_le_bytes());
    block.extend([0u8; 16]);
    let mut g = [Group::default()];
    decode_block(QType::Q5_0, &block, &mut g);
    let w: Vec<f32> = (0..32).map(|i| g[0].weight(i, false)).collect();
    for (i, v) in w.iter().enumerate() {
        assert_eq!(*v, if i == 1 || i == 31 { 0.0 } else { -16.0 }, "{i}");
    }
}

#[test]
fn k4_scales_unpack_six_bits() {
    // Sub-block j < 4: low 6 bits of bytes j and j + 4; j >= 4: a nibble of byte j + 4 and
    // the top 2 bits of bytes j - 4 and j.
    let scales = [0xc1, 2, 3, 4, 0x45, 6, 7, 8, 0x9a, 0, 0, 0];
    assert_eq!(k4_scale_min(&scales, 0), (1, 5));
    assert_eq!(k4_scale_min(&scales, 4), (0xa | (3 << 4), 0x9 | (1 << 4)));
}

#[test]
fn q6_k_layout_by_hand() {
    // Level 63 at weight 130 only (h = 1, s = 0, l = 2): ql[64 + 2] low nibble, qh[32 + 2]
    // bits 0-1; scales[8] (weights 128..144) = 2, d = 1: w = 2 * (63 - 32).
    let mut block = vec![0u8; 210];
    block[66] = 0x0f;
    block[128 + 34] = 0x03;
    block[192 + 8] = 2;
    block[208..210].copy_from_slice(&0x3c00u16.to_le_bytes());
    let mut g = [Group::default(); 8];
    decode_block(QType::Q6K, &block, &mut g);
    assert_eq!(g[4].weight(2, false), 62.0);
    assert_eq!(g[4].weight(3, false), -64.0);
    assert_eq!(g[0].weight(0, false), 0.0);
}

#[test]
fn simd_dequantize_equals_portable_bit_for_bit() {
    let mut rng = Rng::new(7);
    for qtype in QType::ALL {
        let (rows, cols) = (5, 2 * qtype.block_len());
        let data = random_weights(qtype, rows, cols, &mut rng);
        let w = Weights::new(qtype, &data, rows, cols, qtype.row_bytes(cols)).unwrap();
        let mut want = vec![0f32; rows * cols];
        dequantize(&w, &mut want, Isa::Scalar, 1).unwrap();
        for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
            let mut got = vec![f32::NAN; rows * cols];
            dequantize(&w, &mut got, isa, 2).unwrap();
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{} on {}", qtype.name(), isa.name());
        }
    }
}

#[test]
fn layout_errors_are_reported() {
    let data = vec![0u8; 4 * 18];
    assert!(Weights::new(QType::Q4_0, &data, 2, 48, 36).is_err()); // 48 % 32
    assert!(Weights::new(QType::Q4_0, &data, 2, 64, 30).is_err()); // stride < row
    assert!(Weights::new(QType::Q4_0, &data, 3, 64, 36).is_err()); // too few bytes
    assert!(Weights::new(QType::Q4K, &data, 1, 32, 144).is_err()); // 32 % 256
    assert!(Weights::new(QType::Q4_0, &data, 2, 64, 36).is_ok());
    let w = Weights::new(QType::Q4_0, &data, 2, 64, 36).unwrap();
    let run = crate::Run {
        isa: Isa::Scalar,
        kernel: None,
        threads: 1,
    };
    let mut y = vec![0f32; 2];
    assert!(crate::matmul(&w, &[0.0; 63], 1, &mut y, 2, run).is_err());
    assert!(crate::matmul(&w, &[0.0; 64], 1, &mut y, 1, run).is_err());
    assert!(crate::matmul(&w, &[0.0; 128], 2, &mut y, 2, run).is_err());
    assert!(crate::matmul(&w, &[0.0; 64], 1, &mut y, 2, run).is_ok());
    // sizes whose products overflow are errors too, not wrapped
    let huge = usize::MAX / 32 + 2;
    assert!(crate::matmul(&w, &[0.0; 64], huge, &mut y, 2, run).is_err());
    assert!(crate::matmul(&w, &[], 0, &mut y, usize::MAX, run).is_ok()); // n = 0: no rows
}
