//! The element-wise kernels against f64 definitions, and the thread pool's contract.

use super::Rng;
use crate::ops::{gated_mul, rms_norm, rope, Gate, HeadRows};
use crate::pool;
use std::sync::atomic::{AtomicUsize, Ordering};

fn close(got: f32, want: f64, tol: f64) -> bool {
    (got as f64 - want).abs() <= tol * (1.0 + want.abs())
}

#[test]
fn rms_norm_adds_the_residual_and_normalises() {
    let mut rng = Rng(7);
    for (rows, dim, threads) in [(1, 8, 1), (3, 20, 2), (200, 576, 3)] {
        let x: Vec<f32> = (0..rows * dim).map(|_| rng.unit() * 4.0).collect();
        let w: Vec<f32> = (0..dim).map(|_| rng.unit()).collect();
        let mut res: Vec<f32> = (0..rows * dim).map(|_| rng.unit()).collect();
        let before = res.clone();
        let mut out = vec![0f32; rows * dim];
        rms_norm(&x, Some(&mut res), &w, &mut out, 1e-6, threads).unwrap();
        for r in 0..rows {
            let sum: Vec<f64> = (0..dim)
                .map(|j| before[r * dim + j] as f64 + x[r * dim + j] as f64)
                .collect();
            let inv = 1.0 / (sum.iter().map(|v| v * v).sum::<f64>() / dim as f64 + 1e-6).sqrt();
            for j in 0..dim {
                assert!(close(res[r * dim + j], sum[j], 1e-6));
                assert!(close(out[r * dim + j], sum[j] * inv * w[j] as f64, 1e-5));
            }
        }
    }
    let mut out = vec![0f32; 8];
    assert!(rms_norm(&[0f32; 8], None, &[1f32; 3], &mut out, 1e-6, 1).is_err());
}

#[test]
fn gated_mul_is_accurate_over_a_wide_range() {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let silu = |g: f64| g / (1.0 + (-g).exp());
    let gelu = |g: f64| 0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh());
    let cases: [(Gate, &dyn Fn(f64) -> f64); 2] = [(Gate::Silu, &silu), (Gate::GeluTanh, &gelu)];
    let mut rng = Rng(11);
    for (gate, want_act) in cases {
        for (rows, d, threads) in [(1, 5, 1), (4, 16, 2), (64, 1536, 2)] {
            let x: Vec<f32> = (0..rows * 2 * d).map(|_| rng.unit() * 100.0).collect();
            let mut out = vec![0f32; rows * d];
            gated_mul(gate, &x, &mut out, d, threads).unwrap();
            for r in 0..rows {
                for j in 0..d {
                    let (g, u) = (x[r * 2 * d + j] as f64, x[r * 2 * d + d + j] as f64);
                    let want = want_act(g) * u;
                    assert!(close(out[r * d + j], want, 2e-6), "{gate:?} {g} {u}");
                }
            }
        }
        assert!(gated_mul(gate, &[0f32; 6], &mut [0f32; 2], 2, 1).is_err());
    }
    assert!(Gate::from_name("gelu").is_err());
}

#[test]
fn rope_rotates_strided_rows_into_contiguous_ones() {
    let mut rng = Rng(3);
    let (tokens, hq, hk, d, table_rows) = (5, 3, 1, 8, 16);
    let stride = (hq + 2 * hk) * d;
    let qkv: Vec<f32> = (0..tokens * stride).map(|_| rng.unit()).collect();
    let half = d / 2;
    let mut table = Vec::new();
    for p in 0..table_rows {
        let angle = |j: usize| p as f64 * 0.1 * (j + 1) as f64;
        let (cos, sin): (Vec<f32>, Vec<f32>) = (0..half)
            .map(|j| (angle(j).cos() as f32, angle(j).sin() as f32))
            .unzip();
        table.extend(cos.iter().chain(&cos));
        table.extend(sin.iter().map(|s| -s).chain(sin.iter().copied()));
    }
    let positions: Vec<i64> = (0..tokens).map(|_| rng.below(table_rows) as i64).collect();
    let q = HeadRows {
        data: &qkv,
        row_stride: stride,
        heads: hq,
    };
    let k = HeadRows {
        data: &qkv[hq * d..],
        row_stride: stride,
        heads: hk,
    };
    let (mut q_out, mut k_out) = (vec![0f32; tokens * hq * d], vec![0f32; tokens * hk * d]);
    rope(&positions, &table, &q, &k, &mut q_out, &mut k_out, d, 2).unwrap();
    for t in 0..tokens {
        let p = positions[t] as f64;
        for (heads, base, out) in [(hq, 0, &q_out), (hk, hq * d, &k_out)] {
            for h in 0..heads {
                let x = &qkv[t * stride + base + h * d..][..d];
                for j in 0..half {
                    let (c, s) = (
                        (p * 0.1 * (j + 1) as f64).cos(),
                        (p * 0.1 * (j + 1) as f64).sin(),
                    );
                    let (lo, hi) = (x[j] as f64, x[half + j] as f64);
                    assert!(close(out[(t * heads + h) * d + j], lo * c - hi * s, 1e-5));
                    assert!(close(
                        out[(t * heads + h) * d + half + j],
                        hi * c + lo * s,
                        1e-5
                    ));
                }
            }
        }
    }
    let bad = [table_rows as i64];
    assert!(rope(
        &bad,
        &table,
        &q,
        &k,
        &mut q_out[..hq * d],
        &mut k_out[..hk * d],
        d,
        1
    )
    .is_err());
}

#[test]
fn for_each_runs_every_index_once_and_raises_panics_after_the_join() {
    for (n, threads) in [(0, 2), (1, 3), (7, 2), (100, 3)] {
        let counts: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        pool::for_each(n, threads, &|i| {
            counts[i].fetch_add(1, Ordering::Relaxed);
        });
        assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
    }
    let caught = std::panic::catch_unwind(|| {
        pool::for_each(8, 2, &|i| assert!(i != 5, "index five"));
    });
    assert!(caught.is_err());
}

#[test]
fn streamed_shares_run_every_index_once_each_thread_in_order() {
    for (n, threads) in [(0, 2), (1, 3), (7, 2), (100, 3), (1000, 2)] {
        let counts: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        // per thread, the indices it ran from its own share, in order
        let runs = std::sync::Mutex::new(Vec::new());
        pool::for_each_streamed(n, threads, &|i| {
            counts[i].fetch_add(1, Ordering::Relaxed);
            runs.lock().unwrap().push((std::thread::current().id(), i));
        });
        assert!(
            counts.iter().all(|c| c.load(Ordering::Relaxed) == 1),
            "n {n}"
        );
        // each thread starts at a share's front and goes up through it
        let runs = runs.into_inner().unwrap();
        for id in runs
            .iter()
            .map(|r| r.0)
            .collect::<std::collections::HashSet<_>>()
        {
            let mine: Vec<usize> = runs.iter().filter(|r| r.0 == id).map(|r| r.1).collect();
            let start = mine[0];
            let share = (0..threads).find(|&s| n * s / threads == start);
            let end = n * (share.expect("starts at a share's front") + 1) / threads;
            let own: Vec<usize> = mine
                .iter()
                .copied()
                .take_while(|&i| i >= start && i < end)
                .collect();
            assert_eq!(own, (start..start + own.len()).collect::<Vec<_>>());
        }
    }
    let caught = std::panic::catch_unwind(|| {
        pool::for_each_streamed(8, 2, &|i| assert!(i != 5, "index five"));
    });
    assert!(caught.is_err());
}
