//! Every exact kernel, on every instruction set this CPU has, against the float64 reference: odd
//! row counts (tiles and SIMD blocks with remainders), 1 to 9 rows of x and more (register
//! blocks with remainders), one to several blocks per row, strided rows, 1 and 2 threads.

use super::{random_weights, random_x, reference, Reference, Rng};
use crate::format::QType;
use crate::{matmul, Isa, Kernel, Run, Weights};

fn isas() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
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
    let Reference { exact, bound } = reference(qtype, &dense, rows, cols, &x, n);
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
        }
        for pad in rows..ld_y {
            assert!(y[r * ld_y + pad].is_nan(), "{case}: wrote past its columns");
        }
    }
    worst
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
            check(QType::Q4K, 70, 512, n, Kernel::GemmF32, isa, 2, &mut rng);
            check(
                QType::Q5_1,
                70,
                1024 + 32,
                n,
                Kernel::GemmF32,
                isa,
                2,
                &mut rng,
            );
        }
    }
}

/// Rows wider than one pass of the k-quant GEMV (`gemv_k::pass_blocks`: 1024 columns at 8
/// rows of f32 x), with a last pass shorter than the others.
#[test]
fn wide_rows_take_several_passes() {
    let mut rng = Rng::new(14);
    for isa in isas() {
        for qtype in [QType::Q4K, QType::Q5K, QType::Q6K] {
            for n in [4, 8] {
                check(qtype, 9, 256 * 21, n, Kernel::Gemv, isa, 2, &mut rng);
            }
        }
    }
}

#[test]
fn auto_picks_the_gemv_for_decode_and_the_tiles_beyond() {
    assert_eq!(Kernel::auto(1), Kernel::Gemv);
    assert_eq!(Kernel::auto(crate::GEMV_MAX_ROWS), Kernel::Gemv);
    assert_eq!(Kernel::auto(crate::GEMV_MAX_ROWS + 1), Kernel::GemmF32);
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
