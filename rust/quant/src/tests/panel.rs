//! The panel layout and kernels: the repacked groups are the file's, to the bit; every
//! format, precision and instruction set against the float64 product with the rounded
//! activations (the module doc of `tests`'s bound), and against the true activations within
//! the rounding's own bound; remainders of panels, of rows of x and of threads' runs.

use super::{random_weights, random_x, row_groups, Rng};
use crate::format::QType;
use crate::panel::{group, Panels, PANEL_ROWS};
use crate::panel_act::{PanelActs, Precision};
use crate::{panel_bytes, panel_matmul_segments, repack, Isa, Weights};

fn isas() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
}

fn panels_of(qtype: QType, data: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let w = Weights::new(qtype, data, rows, cols, qtype.row_bytes(cols)).unwrap();
    let mut out = vec![0xa5; panel_bytes(qtype, rows, cols)];
    repack(&w, &mut out, 2).unwrap();
    out
}

#[test]
fn repacked_groups_are_the_files_groups() {
    let mut rng = Rng::new(7);
    for qtype in QType::ALL {
        for rows in [1, 15, 16, 17, 40] {
            let cols = 2 * qtype.block_len();
            let data = random_weights(qtype, rows, cols, &mut rng);
            let packed = panels_of(qtype, &data, rows, cols);
            let p = Panels::new(qtype, &packed, rows, cols).unwrap();
            let row_bytes = qtype.row_bytes(cols);
            for r in 0..rows {
                let want = row_groups(qtype, &data[r * row_bytes..][..row_bytes], cols);
                for (gi, want) in want.iter().enumerate() {
                    let (b, g) = (gi / qtype.groups(), gi % qtype.groups());
                    let got = group(qtype, p.block(r / PANEL_ROWS, b), g, r % PANEL_ROWS);
                    assert_eq!(&got, want, "{} row {r} group {gi}", qtype.name());
                }
            }
            // the last panel's padding rows are zero weights
            let last = p.num_panels() - 1;
            for r in p.panel_rows(last)..PANEL_ROWS {
                let g = group(qtype, p.block(last, 0), 0, r);
                assert!((0..32).all(|i| g.weight(i, qtype.is_signed()) == 0.0));
            }
        }
    }
}

/// The float64 product of W (the file's groups) with x as `acts` rounded it, the f32 bound
/// of `tests`' module doc, and `sum |w| |x - x_rounded|` (how far the rounded product may be
/// from the true one), each `[n, rows]`.
fn reference(
    qtype: QType,
    data: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    acts: &PanelActs,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (signed, row_bytes) = (qtype.is_signed(), qtype.row_bytes(cols));
    let u = f64::from(f32::EPSILON) / 2.0;
    let gamma = (cols as f64 / 16.0 + 8.0) * u; // sums of 16 in f32: cols / 16 roundings deep
    let (mut rounded, mut truth, mut bound, mut rounding) = (
        vec![0.0; n * rows],
        vec![0.0; n * rows],
        vec![0.0; n * rows],
        vec![0.0; n * rows],
    );
    for o in 0..rows {
        let groups = row_groups(qtype, &data[o * row_bytes..][..row_bytes], cols);
        for r in 0..n {
            let (mut sum, mut exact, mut magnitude, mut error) = (0f64, 0f64, 0f64, 0f64);
            for c in 0..cols {
                let g = &groups[c / 32];
                let w = f64::from(g.weight(c % 32, signed));
                let xr = f64::from(acts.scale[(r * cols + c) / 32]) * f64::from(acts.level(r, c));
                let xv = f64::from(x[r * cols + c]);
                sum += w * xr;
                exact += w * xv;
                let q = if signed {
                    f64::from(g.q[c % 32] as i8)
                } else {
                    f64::from(g.q[c % 32])
                };
                let s = f64::from(g.scale[c % 32 / 16]);
                magnitude += ((s * q).abs() + f64::from(g.offset[c % 32 / 16]).abs()) * xr.abs();
                error += w.abs() * (xv - xr).abs();
            }
            let at = r * rows + o;
            rounded[at] = sum;
            truth[at] = exact;
            bound[at] = gamma * magnitude + 1e-30;
            rounding[at] = error;
        }
    }
    (rounded, truth, bound, rounding)
}

#[allow(clippy::too_many_arguments)]
fn check(
    qtype: QType,
    rows: usize,
    cols: usize,
    n: usize,
    precision: Precision,
    isa: Isa,
    threads: usize,
    rng: &mut Rng,
) {
    let data = random_weights(qtype, rows, cols, rng);
    let packed = panels_of(qtype, &data, rows, cols);
    let p = Panels::new(qtype, &packed, rows, cols).unwrap();
    let x = random_x(n, cols, rng);
    let ld_y = rows + 5;
    let mut y = vec![f32::NAN; n * ld_y];
    panel_matmul_segments(&[(p, 2)], &x, n, &mut y, ld_y, precision, isa, threads).unwrap();
    let acts = PanelActs::quantize(&x, n, cols, precision);
    let (rounded, truth, bound, rounding) = reference(qtype, &data, rows, cols, &x, n, &acts);
    let case = format!(
        "{} {rows}x{cols} n={n} {} {} t={threads}",
        qtype.name(),
        precision.name(),
        isa.name()
    );
    for r in 0..n {
        for o in 0..rows {
            let got = f64::from(y[r * ld_y + 2 + o]);
            let at = r * rows + o;
            let (want, tol) = (rounded[at], bound[at]);
            assert!(
                (got - want).abs() <= tol,
                "{case}: y[{r},{o}] = {got}, want {want} +- {tol}"
            );
            let tol = tol + rounding[at] + 1e-6 * truth[at].abs();
            assert!(
                (got - truth[at]).abs() <= tol,
                "{case}: vs true x: {got} vs {} +- {tol}",
                truth[at]
            );
        }
        for pad in (0..2).chain(rows + 2..ld_y) {
            assert!(y[r * ld_y + pad].is_nan(), "{case}: wrote past its columns");
        }
    }
}

#[test]
fn every_format_precision_and_isa() {
    let mut rng = Rng::new(11);
    for isa in isas() {
        for qtype in QType::ALL {
            for precision in Precision::ALL {
                for (rows, blocks, n) in [(1, 1, 1), (16, 2, 3), (37, 3, 5), (64, 1, 9)] {
                    let cols = blocks * qtype.block_len();
                    check(qtype, rows, cols, n, precision, isa, 2, &mut rng);
                }
            }
        }
    }
}

#[test]
fn many_panels_over_many_threads_and_a_prefill_batch() {
    let mut rng = Rng::new(3);
    let isa = Isa::best();
    for (qtype, rows, n, threads) in [
        (QType::Q4_1, 16 * 40 + 3, 1, 3),
        (QType::Q8_0, 16 * 9, 37, 2),
        (QType::Q4K, 16 * 5 + 1, 17, 1),
    ] {
        let cols = 2 * qtype.block_len();
        check(
            qtype,
            rows,
            cols,
            n,
            Precision::Int16,
            isa,
            threads,
            &mut rng,
        );
    }
}

#[test]
fn int16_activations_cost_a_hundredth_of_int8s_rounding() {
    // The point of Int16: per value, |x - x_rounded| <= scale / 2 = max|x| / 32766 (int8:
    // max|x| / 254), so the product moves by at most that share of sum |w| max|x|.
    let mut rng = Rng::new(5);
    let (qtype, rows, cols, n) = (QType::Q4_1, 64, 1024, 4);
    let data = random_weights(qtype, rows, cols, &mut rng);
    let x = random_x(n, cols, &mut rng);
    let mut worst = [0f64; 2];
    for (k, precision) in Precision::ALL.into_iter().enumerate() {
        let acts = PanelActs::quantize(&x, n, cols, precision);
        let (_, _, _, rounding) = reference(qtype, &data, rows, cols, &x, n, &acts);
        let row_bytes = qtype.row_bytes(cols);
        for o in 0..rows {
            let groups = row_groups(qtype, &data[o * row_bytes..][..row_bytes], cols);
            for r in 0..n {
                let xs = &x[r * cols..][..cols];
                let size: f64 = (0..cols)
                    .map(|c| {
                        f64::from(groups[c / 32].weight(c % 32, false)).abs()
                            * f64::from(xs[c]).abs()
                    })
                    .sum();
                worst[k] = worst[k].max(rounding[r * rows + o] / size);
            }
        }
    }
    assert!(
        worst[1] < 1.0 / 16383.0 && worst[1] * 100.0 < worst[0],
        "int8 {} int16 {}",
        worst[0],
        worst[1]
    );
}

#[test]
fn a_non_finite_activation_group_gives_nan_outputs() {
    let mut rng = Rng::new(9);
    let (qtype, rows, cols) = (QType::Q4_0, 20, 64);
    let data = random_weights(qtype, rows, cols, &mut rng);
    let packed = panels_of(qtype, &data, rows, cols);
    let p = Panels::new(qtype, &packed, rows, cols).unwrap();
    for bad in [f32::NAN, f32::INFINITY] {
        let mut x = random_x(2, cols, &mut rng);
        x[cols + 40] = bad; // row 1, group 1
        let mut y = vec![0f32; 2 * rows];
        panel_matmul_segments(
            &[(p, 0)],
            &x,
            2,
            &mut y,
            rows,
            Precision::Int16,
            Isa::best(),
            2,
        )
        .unwrap();
        assert!(y[..rows].iter().all(|v| v.is_finite()));
        assert!(y[rows..].iter().all(|v| v.is_nan()));
    }
}

#[test]
fn bad_sizes_and_overlaps_are_errors_not_crashes() {
    let (qtype, rows, cols) = (QType::Q4_0, 16, 64);
    let data = vec![0u8; panel_bytes(qtype, rows, cols)];
    assert!(Panels::new(qtype, &data[1..], rows, cols).is_err());
    assert!(Panels::new(qtype, &data, rows, 48).is_err());
    let p = Panels::new(qtype, &data, rows, cols).unwrap();
    let x = vec![0f32; cols];
    let mut y = vec![0f32; 2 * rows];
    let run = |segs: &[(Panels<'_>, usize)], y: &mut [f32], ld: usize, isa: Isa| {
        panel_matmul_segments(segs, &x, 1, y, ld, Precision::Int8, isa, 1)
    };
    assert!(run(&[(p, 0), (p, 8)], &mut y, 2 * rows, Isa::Scalar).is_err());
    assert!(run(&[(p, 20)], &mut y, 2 * rows, Isa::Scalar).is_err());
    assert!(run(&[(p, 0), (p, 16)], &mut y, 2 * rows, Isa::Scalar).is_ok());
    if let Some(missing) = Isa::ALL.into_iter().find(|i| !i.is_available()) {
        assert!(run(&[(p, 0)], &mut y, rows, missing).is_err());
    }
    let w = Weights::new(
        qtype,
        &data[..qtype.row_bytes(cols) * rows],
        rows,
        cols,
        qtype.row_bytes(cols),
    )
    .unwrap();
    assert!(repack(&w, &mut [0u8; 3], 1).is_err());
}

#[test]
fn panels_dequantize_to_the_files_weights() {
    let mut rng = Rng::new(13);
    for qtype in QType::ALL {
        let (rows, cols) = (19, 2 * qtype.block_len());
        let data = random_weights(qtype, rows, cols, &mut rng);
        let w = Weights::new(qtype, &data, rows, cols, qtype.row_bytes(cols)).unwrap();
        let mut want = vec![0f32; rows * cols];
        crate::dequantize(&w, &mut want, Isa::Scalar, 1).unwrap();
        let packed = panels_of(qtype, &data, rows, cols);
        let mut got = vec![1f32; rows * cols];
        crate::panel::dequantize(&Panels::new(qtype, &packed, rows, cols).unwrap(), &mut got)
            .unwrap();
        assert!(
            want.iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{}",
            qtype.name()
        );
    }
}
