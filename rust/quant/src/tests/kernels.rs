//! Every kernel, on every instruction set this CPU has, against the float64 reference: odd
//! row counts (tiles and SIMD blocks with remainders), 1 to 9 rows of x and more (register
//! blocks with remainders), one to several blocks per row, strided rows, 1 and 2 threads.

use super::{random_weights, random_x, reference, row_groups, Reference, Rng};
use crate::act::Acts;
use crate::format::QType;
use crate::{matmul, Isa, Kernel, Run, Weights};

fn isas() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
}

fn is_int8(kernel: Kernel) -> bool {
    matches!(kernel, Kernel::GemvInt8 | Kernel::GemmInt8)
}

/// Runs one case; checks against the reference; returns the worst error / bound.
#[allow(clippy::too_many_arguments)]
fn check(
    qtype: QType,
    rows: usize,
    cols: usize,
    n: usize,
    kernel: Kernel,
    isa: Isa,
    threads: usize,
    rng: &mut Rng,
) -> f64 {
    let stride = qtype.row_bytes(cols) + qtype.block_bytes() * (rows % 2); // strided when odd
    let mut data = random_weights(
        qtype,
        rows,
        stride / qtype.block_bytes() * qtype.block_len(),
        rng,
    );
    data.truncate(rows * stride);
    let w = Weights::new(qtype, &data, rows, cols, stride).unwrap();
    // The reference reads dense rows.
    let dense: Vec<u8> = (0..rows).flat_map(|r| w.row(r).to_vec()).collect();
    let x = random_x(n, cols, rng);
    let ld_y = rows + 3;
    let mut y = vec![f32::NAN; n * ld_y];
    let run = Run {
        isa,
        kernel: Some(kernel),
        threads,
    };
    assert_eq!(matmul(&w, &x, n, &mut y, ld_y, run).unwrap(), kernel);
    let acts = is_int8(kernel).then(|| Acts::quantize(&x, n, cols));
    let Reference { exact, bound } = reference(qtype, &dense, rows, cols, &x, n, acts.as_ref());
    let truth = acts
        .as_ref()
        .map(|_| reference(qtype, &dense, rows, cols, &x, n, None));
    let case = format!(
        "{} {rows}x{cols} n={n} {} {}",
        qtype.name(),
        kernel.name(),
        isa.name()
    );
    let mut worst = 0f64;
    for r in 0..n {
        for o in 0..rows {
            let got = f64::from(y[r * ld_y + o]);
            let (want, tol) = (exact[r * rows + o], bound[r * rows + o]);
            assert!(
                (got - want).abs() <= tol,
                "{case}: y[{r},{o}] = {got}, want {want} +- {tol}"
            );
            worst = worst.max((got - want).abs() / tol);
            if let (Some(truth), Some(acts)) = (&truth, &acts) {
                let rounding = activation_rounding(qtype, &dense, o, cols, &x, r, acts);
                let want = truth.exact[r * rows + o];
                let tol = truth.bound[r * rows + o] + tol + rounding;
                assert!(
                    (got - want).abs() <= tol,
                    "{case}: vs exact x: {got} vs {want} +- {tol}"
                );
            }
        }
        for pad in rows..ld_y {
            assert!(y[r * ld_y + pad].is_nan(), "{case}: wrote past its columns");
        }
    }
    worst
}

/// `sum |w| * |x - x_rounded|` over row `o` of W and row `r` of x.
fn activation_rounding(
    qtype: QType,
    dense: &[u8],
    o: usize,
    cols: usize,
    x: &[f32],
    r: usize,
    acts: &Acts,
) -> f64 {
    let row_bytes = qtype.row_bytes(cols);
    let groups = row_groups(qtype, &dense[o * row_bytes..][..row_bytes], cols);
    let mut sum = 0f64;
    for c in 0..cols {
        let w = f64::from(groups[c / 32].weight(c % 32, qtype.is_signed()));
        let rounded = f64::from(acts.scale[(r * cols + c) / 32]) * f64::from(acts.q[r * cols + c]);
        sum += w.abs() * (f64::from(x[r * cols + c]) - rounded).abs();
    }
    sum
}

#[test]
fn every_kernel_every_isa_every_format() {
    let mut rng = Rng::new(11);
    for qtype in QType::ALL {
        let block = qtype.block_len();
        let shapes: &[(usize, usize)] = if block == 32 {
            &[(1, 32), (17, 64), (33, 96), (40, 160)]
        } else {
            &[(1, 256), (17, 512), (33, 256), (5, 768)]
        };
        for &(rows, cols) in shapes {
            for kernel in Kernel::ALL {
                for isa in isas() {
                    for n in [1, 2, 3, 5, 8, 9, 13] {
                        check(qtype, rows, cols, n, kernel, isa, 1 + n % 2, &mut rng);
                    }
                }
            }
        }
    }
}

#[test]
fn every_row_count_one_to_nine_on_the_best_isa() {
    let mut rng = Rng::new(12);
    let isa = Isa::best();
    for qtype in [QType::Q4_0, QType::Q6K, QType::Q8_0] {
        for n in 1..=9 {
            for kernel in Kernel::ALL {
                check(
                    qtype,
                    35,
                    qtype.block_len() * 2,
                    n,
                    kernel,
                    isa,
                    2,
                    &mut rng,
                );
            }
        }
    }
}

#[test]
fn large_batches_cover_every_tile_remainder() {
    let mut rng = Rng::new(13);
    for isa in isas() {
        for n in [16, 21, 31] {
            for kernel in [Kernel::GemmF32, Kernel::GemmInt8] {
                check(QType::Q4K, 70, 512, n, kernel, isa, 2, &mut rng);
                check(QType::Q5_1, 70, 1024 + 32, n, kernel, isa, 2, &mut rng);
            }
        }
    }
}

/// Rows wider than one pass of the k-quant GEMVs (`gemv_k::pass_blocks`: 1024 columns at 8
/// rows of f32 x, 4096 at 8 of int8), with a last pass shorter than the others.
#[test]
fn wide_rows_take_several_passes() {
    let mut rng = Rng::new(14);
    for isa in isas() {
        for qtype in [QType::Q4K, QType::Q5K, QType::Q6K] {
            for kernel in [Kernel::Gemv, Kernel::GemvInt8] {
                for n in [4, 8] {
                    check(qtype, 9, 256 * 21, n, kernel, isa, 2, &mut rng);
                }
            }
        }
    }
}

#[test]
fn auto_picks_the_gemv_for_decode_and_the_tiles_beyond() {
    assert_eq!(Kernel::auto(1), Kernel::GemvInt8);
    assert_eq!(Kernel::auto(crate::GEMV_MAX_ROWS), Kernel::GemvInt8);
    assert_eq!(Kernel::auto(crate::GEMV_MAX_ROWS + 1), Kernel::GemmInt8);
}

#[test]
fn unavailable_isa_is_an_error_not_a_crash() {
    let data = vec![0u8; 34];
    let w = Weights::new(QType::Q8_0, &data, 1, 32, 34).unwrap();
    for isa in Isa::ALL.into_iter().filter(|i| !i.is_available()) {
        let run = Run {
            isa,
            kernel: None,
            threads: 1,
        };
        assert!(matmul(&w, &[0.0; 32], 1, &mut [0.0], 1, run).is_err());
    }
}

/// The activations' AVX-512 rounding gives the portable loop's levels, scales and sums bit
/// for bit: random groups, an all-zero group, exact ties (`v * inv` = k + 1/2), huge and tiny
/// magnitudes, infinities, and a group with a NaN (left to the portable loop).
#[test]
fn activation_rounding_simd_equals_portable() {
    if !Isa::Avx512.is_available() {
        return;
    }
    let mut rng = Rng::new(15);
    let mut x = random_x(8, 256, &mut rng);
    x[32..64].fill(0.0);
    for (i, v) in x[64..96].iter_mut().enumerate() {
        *v = (i as f32 - 15.5) * 127.0 / 16.0 * 2.0 / 127.0 * 63.5; // halves of the scale
    }
    x[96..128].iter_mut().for_each(|v| *v *= 1e30);
    x[128..160].iter_mut().for_each(|v| *v *= 1e-38);
    x[160] = f32::INFINITY;
    x[200] = f32::NAN;
    let (simd, portable) = (
        Acts::quantize_with(&x, 8, 256, true),
        Acts::quantize_with(&x, 8, 256, false),
    );
    assert_eq!(simd.q, portable.q);
    assert_eq!(simd.qsum16, portable.qsum16);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&simd.scale), bits(&portable.scale));
    assert_eq!(bits(&simd.scale16), bits(&portable.scale16));
    assert_eq!(bits(&simd.sum16), bits(&portable.sum16));
    assert_eq!(bits(&simd.sum32), bits(&portable.sum32));
}

#[test]
fn the_k_order_moves_each_run_of_four_levels_to_its_lane() {
    let x: Vec<f32> = (0..512)
        .map(|i| ((i % 251) as f32 - 125.0) / 125.0)
        .collect();
    let mut acts = Acts::quantize(&x, 1, 512);
    acts.arrange_k(512);
    for (at, &q) in acts.qk.iter().enumerate() {
        let (block, k, lane, byte) = (at / 256, at % 256 / 64, at % 64 / 4, at % 4);
        assert_eq!(
            q,
            acts.q[256 * block + 16 * lane + 4 * k + byte],
            "qk[{at}]"
        );
    }
    let mut odd = Acts::quantize(&x[..96], 1, 96);
    odd.arrange_k(96);
    assert!(
        odd.qk.is_empty(),
        "rows that are not whole super-blocks stay unarranged"
    );
}
