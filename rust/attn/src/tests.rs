//! Against a plain f64 reference, on random layouts (a small xorshift; no dependencies).

use super::*;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

struct Case {
    dims: Dims,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    table: Vec<i32>,
    width: usize,
    rows: Vec<i64>,
    seq_lens: Vec<i64>,
}

fn case(rng: &mut Rng, n: usize, max_len: usize, dims: Dims) -> Case {
    let num_slots = max_len * n + 7;
    let slot_len = dims.num_kv_heads * dims.head_dim;
    let mut fill = |len: usize| (0..len).map(|_| rng.unit() * 2.0).collect::<Vec<f32>>();
    let q = fill(n * dims.num_heads * dims.head_dim);
    let k = fill(num_slots * slot_len);
    let v = fill(num_slots * slot_len);
    let table_rows = n + 3;
    let table: Vec<i32> = (0..table_rows * max_len)
        .map(|_| rng.below(num_slots) as i32)
        .collect();
    let rows = (0..n).map(|_| rng.below(table_rows) as i64).collect();
    let seq_lens = (0..n).map(|_| 1 + rng.below(max_len) as i64).collect();
    Case {
        dims,
        q,
        k,
        v,
        table,
        width: max_len,
        rows,
        seq_lens,
    }
}

fn problem(c: &Case) -> Problem<'_, f32> {
    Problem {
        q: &c.q,
        k: &c.k,
        v: &c.v,
        table: &c.table,
        table_width: c.width,
        rows: &c.rows,
        seq_lens: &c.seq_lens,
        dims: c.dims,
        scale: 0.125,
    }
}

fn reference(p: &Problem<'_, f32>) -> Vec<f64> {
    let Dims {
        num_heads,
        num_kv_heads,
        head_dim: d,
    } = p.dims;
    let group = num_heads / num_kv_heads;
    let mut out = vec![0f64; p.q.len()];
    for (i, (&row, &len)) in p.rows.iter().zip(p.seq_lens).enumerate() {
        let slots = &p.table[row as usize * p.table_width..][..len as usize];
        for h in 0..num_heads {
            let kv = h / group;
            let q = &p.q[(i * num_heads + h) * d..][..d];
            let scores: Vec<f64> = slots
                .iter()
                .map(|&s| {
                    let key = &p.k[(s as usize * num_kv_heads + kv) * d..][..d];
                    q.iter()
                        .zip(key)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * p.scale as f64
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for (w, &s) in weights.iter().zip(slots) {
                let value = &p.v[(s as usize * num_kv_heads + kv) * d..][..d];
                for (o, x) in out[(i * num_heads + h) * d..][..d].iter_mut().zip(value) {
                    *o += w / total * *x as f64;
                }
            }
        }
    }
    out
}

fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn matches_the_reference_on_random_layouts() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let layouts = [(9, 3, 64), (4, 4, 16), (8, 1, 128), (6, 2, 20), (2, 2, 3)];
    for (round, &(num_heads, num_kv_heads, head_dim)) in layouts.iter().cycle().take(40).enumerate()
    {
        let dims = Dims {
            num_heads,
            num_kv_heads,
            head_dim,
        };
        let n = 1 + rng.below(12);
        let max_len = 1 + rng.below(if round % 3 == 0 { 1200 } else { 60 });
        let c = case(&mut rng, n, max_len, dims);
        let p = problem(&c);
        let want = reference(&p);
        for threads in [1, 2, 5] {
            let mut out = vec![0f32; c.q.len()];
            decode_attention(&p, &mut out, threads).unwrap();
            let diff = max_abs_diff(&out, &want);
            assert!(
                diff < 2e-5,
                "round {round} threads {threads}: max diff {diff}"
            );
        }
    }
}

#[test]
fn bf16_inputs_round_like_torch() {
    assert_eq!(Bf16::from_f32(1.0).0, 0x3f80);
    assert_eq!(Bf16::from_f32(1.0 + 1.0 / 256.0).0, 0x3f80); // tie, to even
    assert_eq!(Bf16::from_f32(1.0 + 3.0 / 256.0).0, 0x3f82); // tie, to even (up)
    assert_eq!(Bf16::from_f32(-2.5).to_f32(), -2.5);
    assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
    assert_eq!(Bf16::from_f32(f32::MAX).to_f32(), f32::INFINITY);

    let mut rng = Rng(12345);
    let dims = Dims {
        num_heads: 8,
        num_kv_heads: 2,
        head_dim: 32,
    };
    let c = case(&mut rng, 5, 300, dims);
    let round = |xs: &[f32]| xs.iter().map(|&x| Bf16::from_f32(x)).collect::<Vec<_>>();
    let (q, k, v) = (round(&c.q), round(&c.k), round(&c.v));
    let widen = |xs: &[Bf16]| xs.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
    let (qf, kf, vf) = (widen(&q), widen(&k), widen(&v));
    let p = Problem {
        q: &q,
        k: &k,
        v: &v,
        ..bf16_shell(&c)
    };
    let mut out = vec![Bf16::default(); q.len()];
    decode_attention(&p, &mut out, 2).unwrap();
    let pf = Problem {
        q: &qf,
        k: &kf,
        v: &vf,
        ..problem(&c)
    };
    let want = reference(&pf);
    let got: Vec<f32> = widen(&out);
    assert!(max_abs_diff(&got, &want) < 1e-2);
}

fn bf16_shell(c: &Case) -> Problem<'_, Bf16> {
    Problem {
        q: &[],
        k: &[],
        v: &[],
        table: &c.table,
        table_width: c.width,
        rows: &c.rows,
        seq_lens: &c.seq_lens,
        dims: c.dims,
        scale: 0.125,
    }
}

#[test]
fn bad_layouts_are_errors_and_leave_out_untouched() {
    let mut rng = Rng(77);
    let dims = Dims {
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
    };
    let c = case(&mut rng, 3, 10, dims);
    let check = |p: Problem<'_, f32>, needle: &str| {
        let mut out = vec![7f32; c.q.len()];
        let e = decode_attention(&p, &mut out, 2).unwrap_err();
        assert!(e.0.contains(needle), "{e} lacks {needle:?}");
        assert!(out.iter().all(|&x| x == 7.0));
    };
    check(
        Problem {
            dims: Dims {
                num_heads: 3,
                ..dims
            },
            ..problem(&c)
        },
        "head layout",
    );
    check(
        Problem {
            q: &c.q[1..],
            ..problem(&c)
        },
        "q has",
    );
    check(
        Problem {
            v: &c.v[..8],
            ..problem(&c)
        },
        "k has",
    );
    let rows = vec![0, 99, 1];
    check(
        Problem {
            rows: &rows,
            ..problem(&c)
        },
        "outside the table",
    );
    let lens = vec![1, 11, 1];
    check(
        Problem {
            seq_lens: &lens,
            ..problem(&c)
        },
        "seq_len 11",
    );
    let lens = vec![1, 0, 1];
    check(
        Problem {
            seq_lens: &lens,
            ..problem(&c)
        },
        "seq_len 0",
    );
    let mut table = c.table.clone();
    table[c.rows[0] as usize * c.width] = -1;
    check(
        Problem {
            table: &table,
            ..problem(&c)
        },
        "slot -1",
    );
    check(
        Problem {
            rows: &c.rows[..2],
            ..problem(&c)
        },
        "seq_lens",
    );
}

#[test]
fn tasks_split_into_balanced_contiguous_ranges() {
    let costs = [1000, 10, 10, 10, 1000, 1000, 5];
    for threads in 1..6 {
        let cuts = split_tasks(&costs, threads);
        assert_eq!(cuts[0], 0);
        assert_eq!(*cuts.last().unwrap(), costs.len());
        assert!(cuts.windows(2).all(|w| w[0] < w[1]), "{cuts:?}");
        assert!(cuts.len() <= threads + 1);
    }
    assert_eq!(split_tasks(&[1000, 1000], 2), vec![0, 1, 2]);
    assert_eq!(split_tasks(&[5], 4), vec![0, 1]);
    assert_eq!(split_tasks(&[], 4), vec![0, 0]);
}

#[test]
fn rows_sharing_a_prefix_are_grouped() {
    let dims = Dims {
        num_heads: 2,
        num_kv_heads: 2,
        head_dim: 4,
    };
    let width = 40;
    let prefix: Vec<i32> = (100..130).collect(); // 30 shared slots
    let mut table = vec![0i32; 5 * width];
    for (r, row) in table.chunks_exact_mut(width).enumerate() {
        row[..30].copy_from_slice(&prefix);
        for (t, x) in row[30..].iter_mut().enumerate() {
            *x = 1000 + (r * width + t) as i32;
        }
    }
    table[2 * width + 20] = 7; // row 2 leaves the prefix at position 20
    table[4 * width] = 5; // row 4 starts elsewhere
    let rows = vec![0i64, 1, 2, 3, 4];
    let lens = vec![35i64, 40, 33, 12, 3];
    let p: Problem<'_, f32> = Problem {
        q: &[],
        k: &[],
        v: &[],
        table: &table,
        table_width: width,
        rows: &rows,
        seq_lens: &lens,
        dims,
        scale: 1.0,
    };
    let groups = plan_of(&p).groups;
    let got: Vec<(Vec<usize>, usize)> = groups
        .iter()
        .map(|g| (g.members.clone(), g.shared))
        .collect();
    // row 4 (first slot 5) alone; rows 0-2 share 20 positions; row 3 (12 long) shares fewer
    // than MIN_SHARED and runs alone
    assert_eq!(got, vec![(vec![4], 0), (vec![0, 1, 2], 20), (vec![3], 0)]);
}

#[test]
fn groups_match_the_reference() {
    let mut rng = Rng(99);
    let dims = Dims {
        num_heads: 6,
        num_kv_heads: 2,
        head_dim: 64,
    };
    let mut c = case(&mut rng, 20, 300, dims);
    // three prefixes of different lengths shared by most rows, a few rows alone
    for (r, row) in c.table.chunks_exact_mut(c.width).enumerate() {
        let (src, len) = [(0usize, 256usize), (1, 40), (2, 17), (3, 0)][r % 4];
        if len > 0 && r >= 4 {
            let lead: Vec<i32> = (0..len).map(|t| (src * 300 + t) as i32).collect();
            row[..len].copy_from_slice(&lead);
        }
    }
    c.rows = (0..20).map(|i| i as i64).collect();
    let p = problem(&c);
    assert!(plan_of(&p)
        .groups
        .iter()
        .any(|g| g.members.len() > 2 && g.shared >= 17));
    let want = reference(&p);
    for threads in [1, 2, 3] {
        let mut out = vec![0f32; c.q.len()];
        decode_attention(&p, &mut out, threads).unwrap();
        assert!(max_abs_diff(&out, &want) < 2e-5);
    }
}

#[test]
fn exp_is_accurate_on_the_softmax_range() {
    let mut worst = 0f64;
    for i in 0..=87_000 {
        let x = -(i as f32) / 1000.0;
        let got = exp::exp_nonpositive(x) as f64;
        let want = (x as f64).exp();
        worst = worst.max(((got - want) / want).abs());
    }
    assert!(worst < 5e-7, "relative error {worst}");
    assert!(exp::exp_nonpositive(-1000.0) > 0.0);
}

fn plan_of(p: &Problem<'_, f32>) -> DecodePlan {
    DecodePlan::new(
        p.table,
        p.table_width,
        p.rows,
        p.seq_lens,
        p.dims.num_kv_heads,
    )
    .unwrap()
}

#[test]
fn one_plan_serves_every_layer_and_checks_each() {
    let mut rng = Rng(2024);
    let dims = Dims {
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
    };
    let c = case(&mut rng, 6, 50, dims);
    let plan = plan_of(&problem(&c));
    let slot_len = dims.num_kv_heads * dims.head_dim;
    for layer_seed in 0..3u64 {
        let mut layer_rng = Rng(77 + layer_seed);
        let k: Vec<f32> = (0..c.k.len()).map(|_| layer_rng.unit()).collect();
        let v: Vec<f32> = (0..c.v.len()).map(|_| layer_rng.unit()).collect();
        let layer = Layer {
            q: &c.q,
            k: &k,
            v: &v,
            dims,
            scale: 0.125,
        };
        let mut out = vec![0f32; c.q.len()];
        plan.run(&layer, &mut out, 2).unwrap();
        let want = reference(&Problem {
            k: &k,
            v: &v,
            ..problem(&c)
        });
        assert!(max_abs_diff(&out, &want) < 2e-5);
    }
    // a pool too small for the plan's largest slot, or another head layout: errors
    let largest = (0..plan.num_rows())
        .flat_map(|i| plan.slots(i))
        .max()
        .copied()
        .unwrap() as usize;
    let small = vec![0f32; largest * slot_len];
    let mut out = vec![7f32; c.q.len()];
    let layer = Layer {
        q: &c.q,
        k: &small,
        v: &small,
        dims,
        scale: 1.0,
    };
    let e = plan.run(&layer, &mut out, 2).unwrap_err();
    assert!(e.0.contains("outside the pool"), "{e}");
    let other = Dims {
        num_heads: 4,
        num_kv_heads: 4,
        head_dim: 8,
    };
    let layer = Layer {
        q: &c.q,
        k: &c.k,
        v: &c.v,
        dims: other,
        scale: 1.0,
    };
    assert!(plan
        .run(&layer, &mut out, 2)
        .unwrap_err()
        .0
        .contains("head layout"));
    assert!(out.iter().all(|&x| x == 7.0));
}
