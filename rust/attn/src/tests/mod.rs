//! Against a plain f64 reference, on random layouts (a small xorshift; no dependencies).

use super::*;

pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub(super) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub(super) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

pub(super) struct Case {
    dims: Dims,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    table: Vec<i32>,
    width: usize,
    rows: Vec<i64>,
    seq_lens: Vec<i64>,
}

pub(super) fn case(rng: &mut Rng, n: usize, max_len: usize, dims: Dims) -> Case {
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

pub(super) fn problem(c: &Case) -> Problem<'_, f32> {
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
        window: None,
        variant: Variant::default(),
    }
}

/// The definition in f64: row i's last `window` keys, scores capped, softmax with the sink.
pub(super) fn reference(p: &Problem<'_, f32>) -> Vec<f64> {
    let Dims {
        num_heads,
        num_kv_heads,
        head_dim: d,
        v_dim: dv,
    } = p.dims;
    let group = num_heads / num_kv_heads;
    let cap = p.variant.logit_cap as f64;
    let num_slots = p.k.len() / (num_kv_heads * d);
    let v_row = p.v.len() / (num_slots * num_kv_heads);
    let mut out = vec![0f64; p.q.len() / d * dv];
    for (i, (&row, &len)) in p.rows.iter().zip(p.seq_lens).enumerate() {
        let len = len as usize;
        let first = len.saturating_sub(p.window.unwrap_or(len));
        let slots = &p.table[row as usize * p.table_width..][first..len];
        for h in 0..num_heads {
            let kv = h / group;
            let q = &p.q[(i * num_heads + h) * d..][..d];
            let scores: Vec<f64> = slots
                .iter()
                .map(|&s| {
                    let key = &p.k[(s as usize * num_kv_heads + kv) * d..][..d];
                    let s = q
                        .iter()
                        .zip(key)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * p.scale as f64;
                    if cap > 0.0 {
                        cap * (s / cap).tanh()
                    } else {
                        s
                    }
                })
                .collect();
            let sink = p.variant.sinks.map(|s| s[h] as f64);
            let max = scores
                .iter()
                .cloned()
                .chain(sink)
                .fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - max).exp());
            for (w, &s) in weights.iter().zip(slots) {
                let value = &p.v[(s as usize * num_kv_heads + kv) * v_row..][..dv];
                for (o, x) in out[(i * num_heads + h) * dv..][..dv].iter_mut().zip(value) {
                    *o += w / total * *x as f64;
                }
            }
        }
    }
    out
}

pub(super) fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
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
        let dims = Dims::same(num_heads, num_kv_heads, head_dim);
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
    let dims = Dims::same(8, 2, 32);
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
        window: None,
        variant: Variant::default(),
    }
}

#[test]
fn bad_layouts_are_errors_and_leave_out_untouched() {
    let mut rng = Rng(77);
    let dims = Dims::same(4, 2, 8);
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

mod ops;
mod plan;
mod variants;

/// MLA's absorbed decode: one KV head whose values are the first `v_dim` dims of each key
/// row (the pool's key rows passed as `v`), and a separate narrower value buffer.
#[test]
fn values_narrower_than_keys() {
    let mut rng = Rng(0x51ab);
    for (num_heads, head_dim, v_dim) in [(16, 40, 32), (4, 576, 512), (3, 24, 7)] {
        let dims = Dims {
            v_dim,
            ..Dims::same(num_heads, 1, head_dim)
        };
        let c = case(&mut rng, 5, 70, dims);
        let num_slots = c.k.len() / head_dim;
        let narrow: Vec<f32> = (0..num_slots * v_dim).map(|_| rng.unit()).collect();
        for v in [&c.k, &narrow] {
            let p = Problem { v, ..problem(&c) };
            let want = reference(&p);
            let mut got = vec![0f32; want.len()];
            decode_attention(&p, &mut got, 2).unwrap();
            assert!(max_abs_diff(&got, &want) < 1e-4, "{dims:?}");
        }
    }
    let c = case(&mut rng, 2, 9, Dims::same(4, 1, 16));
    for v_dim in [0, 17] {
        let p = Problem {
            dims: Dims {
                v_dim,
                ..Dims::same(4, 1, 16)
            },
            ..problem(&c)
        };
        let mut out = vec![0f32; 2 * 4 * 16];
        assert!(decode_attention(&p, &mut out, 1).is_err());
    }
}
