//! The per-layer variations (sliding window, logit soft-cap, sinks) against the f64 reference.

use super::*;

#[test]
fn windows_caps_and_sinks_match_the_reference() {
    let mut rng = Rng(0x5eed);
    let layouts = [(8, 2, 64), (4, 1, 16), (6, 3, 20), (2, 2, 128)];
    for (round, &(num_heads, num_kv_heads, head_dim)) in layouts.iter().cycle().take(24).enumerate()
    {
        let dims = Dims::same(num_heads, num_kv_heads, head_dim);
        let n = 1 + rng.below(10);
        let max_len = 1 + rng.below(if round % 4 == 0 { 900 } else { 70 });
        let c = case(&mut rng, n, max_len, dims);
        // windows shorter than, equal to and longer than the rows
        let window = [None, Some(1), Some(7), Some(max_len), Some(max_len + 5)][round % 5];
        let sinks: Vec<f32> = (0..num_heads).map(|_| rng.unit() * 3.0).collect();
        let variant = Variant {
            logit_cap: [0.0, 0.7, 5.0][round % 3],
            sinks: (round % 2 == 0).then_some(&sinks[..]),
        };
        let p = Problem {
            window,
            variant,
            ..problem(&c)
        };
        let want = reference(&p);
        for threads in [1, 3] {
            let mut out = vec![0f32; c.q.len()];
            decode_attention(&p, &mut out, threads).unwrap();
            let diff = max_abs_diff(&out, &want);
            assert!(
                diff < 2e-5,
                "round {round} window {window:?} cap {} threads {threads}: max diff {diff}",
                variant.logit_cap
            );
        }
    }
}

#[test]
fn a_window_reads_only_the_last_keys() {
    // keys before the window hold NaN: reading any of them would poison the output
    let mut rng = Rng(3);
    let dims = Dims::same(2, 1, 16);
    let mut c = case(&mut rng, 4, 40, dims);
    c.seq_lens = vec![40, 12, 5, 33];
    c.rows = vec![0, 1, 2, 3];
    let window = 6;
    let mut k = vec![f32::NAN; c.k.len()];
    let mut v = vec![f32::NAN; c.v.len()];
    for (i, &len) in c.seq_lens.iter().enumerate() {
        let len = len as usize;
        // distinct slots per row, so no row's window holds another row's stale key
        for (t, slot) in c.table[i * c.width..][..len].iter_mut().enumerate() {
            *slot = (i * c.width + t) as i32;
            if t + window >= len {
                let at = *slot as usize * dims.head_dim;
                k[at..at + dims.head_dim].copy_from_slice(&c.k[at..at + dims.head_dim]);
                v[at..at + dims.head_dim].copy_from_slice(&c.v[at..at + dims.head_dim]);
            }
        }
    }
    let p = Problem {
        k: &k,
        v: &v,
        window: Some(window),
        ..problem(&c)
    };
    let mut out = vec![0f32; c.q.len()];
    decode_attention(&p, &mut out, 2).unwrap();
    assert!(out.iter().all(|x| x.is_finite()));
    assert!(max_abs_diff(&out, &reference(&p)) < 2e-5);
}

#[test]
fn bad_variants_are_errors() {
    let mut rng = Rng(8);
    let dims = Dims::same(4, 2, 8);
    let c = case(&mut rng, 3, 10, dims);
    let mut out = vec![7f32; c.q.len()];
    let sinks = [0.0f32; 3];
    for (p, needle) in [
        (
            Problem {
                window: Some(0),
                ..problem(&c)
            },
            "window must be >= 1",
        ),
        (
            Problem {
                variant: Variant {
                    logit_cap: f32::NAN,
                    sinks: None,
                },
                ..problem(&c)
            },
            "logit_cap",
        ),
        (
            Problem {
                variant: Variant {
                    logit_cap: 0.0,
                    sinks: Some(&sinks),
                },
                ..problem(&c)
            },
            "3 sinks for 4 query heads",
        ),
    ] {
        let e = decode_attention(&p, &mut out, 1).unwrap_err();
        assert!(e.0.contains(needle), "{e} lacks {needle:?}");
    }
    assert!(out.iter().all(|&x| x == 7.0));
}

#[test]
fn soft_cap_is_accurate_everywhere() {
    let cap = 30.0f32;
    let mut worst_abs = 0f64; // in units of the cap
    let mut worst_rel = 0f64;
    for i in -200_000..=200_000 {
        let s = i as f32 * 1e-3 * cap / 10.0; // s / cap in [-20, 20]
        let mut row = [s];
        exp::soft_cap(&mut row, cap);
        let want = cap as f64 * (s as f64 / cap as f64).tanh();
        let err = (row[0] as f64 - want).abs();
        worst_abs = worst_abs.max(err / cap as f64);
        if want != 0.0 {
            worst_rel = worst_rel.max(err / want.abs());
        }
    }
    assert!(worst_abs < 2e-7, "abs error {worst_abs}");
    assert!(worst_rel < 1e-6, "rel error {worst_rel}");
    let mut row = [0.0, -0.0, 1e-30, f32::INFINITY, f32::NEG_INFINITY];
    exp::soft_cap(&mut row, 2.0);
    assert_eq!(row[..3], [0.0, 0.0, 1e-30]);
    assert_eq!(row[3..], [2.0, -2.0]);
}
