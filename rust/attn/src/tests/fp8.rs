//! fp8 K/V (e4m3fn, e5m2) under f32 and bf16 queries: the tables, the vector loads, the kernel.

use super::*;
use crate::fp8::{E4M3, E5M2};

fn value(table: &[u32; 256], byte: u8) -> f32 {
    f32::from_bits(table[byte as usize])
}

#[test]
fn tables_hold_each_formats_values() {
    let e4m3 = |b| value(&E4M3, b);
    assert_eq!(e4m3(0x00), 0.0);
    assert_eq!(e4m3(0x80).to_bits(), (-0.0f32).to_bits());
    assert_eq!(e4m3(0x38), 1.0); // exponent 7 = bias
    assert_eq!(e4m3(0x3c), 1.5);
    assert_eq!(e4m3(0x7e), 448.0); // the finite max
    assert_eq!(e4m3(0xfe), -448.0);
    assert!(e4m3(0x7f).is_nan() && e4m3(0xff).is_nan());
    assert_eq!(e4m3(0x01), 2f32.powi(-9)); // smallest subnormal
    assert_eq!(e4m3(0x07), 7.0 * 2f32.powi(-9));
    assert_eq!(e4m3(0x08), 2f32.powi(-6)); // smallest normal
    let e5m2 = |b| value(&E5M2, b);
    assert_eq!(e5m2(0x3c), 1.0);
    assert_eq!(e5m2(0x7b), 57344.0);
    assert_eq!(e5m2(0x7c), f32::INFINITY);
    assert_eq!(e5m2(0xfc), f32::NEG_INFINITY);
    assert!(e5m2(0x7d).is_nan() && e5m2(0xff).is_nan());
    assert_eq!(e5m2(0x01), 2f32.powi(-16));
    assert_eq!(e5m2(0x04), 2f32.powi(-14));
    // each format's bytes are ordered like their values (the positive half)
    for table in [&E4M3, &E5M2] {
        let finite: Vec<f32> = (0..0x7c).map(|b| value(table, b)).collect();
        assert!(finite.windows(2).all(|w| w[0] < w[1]));
    }
}

#[test]
fn vector_loads_widen_every_byte_like_the_tables() {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::kernel::x86::{load16, load8};
        use std::arch::x86_64::*;
        let bytes: Vec<u8> = (0..=255).collect();
        let same =
            |got: f32, want: f32| got.to_bits() == want.to_bits() || got.is_nan() && want.is_nan();
        for chunk in bytes.chunks(16) {
            let (a, b) = (
                chunk.iter().map(|&x| E4m3(x)).collect::<Vec<_>>(),
                chunk.iter().map(|&x| E5m2(x)).collect::<Vec<_>>(),
            );
            let mut got = [0f32; 16];
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: AVX-512F is present; 16 elements at each pointer.
                unsafe {
                    _mm512_storeu_ps(got.as_mut_ptr(), load16(a.as_ptr()));
                    assert!(got.iter().zip(&a).all(|(g, x)| same(*g, x.to_f32())));
                    _mm512_storeu_ps(got.as_mut_ptr(), load16(b.as_ptr()));
                    assert!(got.iter().zip(&b).all(|(g, x)| same(*g, x.to_f32())));
                }
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                // SAFETY: AVX2, FMA and F16C are present; 8 elements at each pointer.
                unsafe {
                    for half in 0..2 {
                        _mm256_storeu_ps(got.as_mut_ptr(), load8(a[half * 8..].as_ptr()));
                        assert!(got[..8]
                            .iter()
                            .zip(&a[half * 8..])
                            .all(|(g, x)| same(*g, x.to_f32())));
                        _mm256_storeu_ps(got.as_mut_ptr(), load8(b[half * 8..].as_ptr()));
                        assert!(got[..8]
                            .iter()
                            .zip(&b[half * 8..])
                            .all(|(g, x)| same(*g, x.to_f32())));
                    }
                }
            }
        }
    }
}

/// A random finite byte of the format (no NaN, no infinity), below `limit` in magnitude.
fn finite_byte(rng: &mut Rng, table: &[u32; 256], limit: f32) -> u8 {
    loop {
        let b = rng.below(256) as u8;
        let x = value(table, b);
        if x.is_finite() && x.abs() <= limit {
            return b;
        }
    }
}

fn check_fp8<K: KvElem>(wrap: fn(u8) -> K, table: &[u32; 256], seed: u64) {
    let mut rng = Rng(seed);
    for (round, &(num_heads, num_kv_heads, head_dim)) in
        [(9, 3, 64), (8, 1, 128), (6, 2, 20), (4, 4, 16), (2, 2, 3)]
            .iter()
            .enumerate()
    {
        let (n, max_len) = (1 + rng.below(6), 1 + rng.below(300));
        let dims = Dims::same(num_heads, num_kv_heads, head_dim);
        let c = case(&mut rng, n, max_len, dims);
        let mut bytes = |n: usize| {
            (0..n)
                .map(|_| finite_byte(&mut rng, table, 4.0))
                .collect::<Vec<u8>>()
        };
        let (kb, vb) = (bytes(c.k.len()), bytes(c.v.len()));
        let (k, v): (Vec<K>, Vec<K>) = (
            kb.iter().map(|&b| wrap(b)).collect(),
            vb.iter().map(|&b| wrap(b)).collect(),
        );
        let (kf, vf): (Vec<f32>, Vec<f32>) = (
            k.iter().map(|x| x.to_f32()).collect(),
            v.iter().map(|x| x.to_f32()).collect(),
        );
        let want = reference(&Problem {
            k: &kf,
            v: &vf,
            ..problem(&c)
        });
        for threads in [1, 3] {
            let p = Problem {
                q: &c.q,
                k: &k,
                v: &v,
                table: &c.table,
                table_width: c.width,
                rows: &c.rows,
                seq_lens: &c.seq_lens,
                dims: c.dims,
                scale: 0.125,
                window: None,
                variant: Variant::default(),
            };
            let mut out = vec![0f32; c.q.len()];
            decode_attention(&p, &mut out, threads).unwrap();
            let diff = max_abs_diff(&out, &want);
            assert!(
                diff < 2e-5,
                "round {round} threads {threads}: max diff {diff}"
            );
            // bf16 queries over the same pool
            let qb: Vec<Bf16> = c.q.iter().map(|&x| Bf16::from_f32(x)).collect();
            let qbf: Vec<f32> = qb.iter().map(|x| x.to_f32()).collect();
            let want_b = reference(&Problem {
                q: &qbf,
                k: &kf,
                v: &vf,
                ..problem(&c)
            });
            let pb = Problem {
                q: &qb,
                k: &k,
                v: &v,
                table: &c.table,
                table_width: c.width,
                rows: &c.rows,
                seq_lens: &c.seq_lens,
                dims: c.dims,
                scale: 0.125,
                window: None,
                variant: Variant::default(),
            };
            let mut out_b = vec![Bf16::default(); qb.len()];
            decode_attention(&pb, &mut out_b, threads).unwrap();
            let got_b: Vec<f32> = out_b.iter().map(|x| x.to_f32()).collect();
            assert!(
                max_abs_diff(&got_b, &want_b) < 2e-2,
                "round {round}: bf16 q"
            );
        }
    }
}

#[test]
fn fp8_pools_match_the_reference_on_their_widened_values() {
    check_fp8(E4m3, &E4M3, 0xfeed);
    check_fp8(E5m2, &E5M2, 0xbeef);
}

#[test]
fn bf16_pool_under_f32_queries() {
    let mut rng = Rng(4242);
    let c = case(&mut rng, 5, 200, Dims::same(8, 2, 64));
    let (k, v): (Vec<Bf16>, Vec<Bf16>) = (
        c.k.iter().map(|&x| Bf16::from_f32(x)).collect(),
        c.v.iter().map(|&x| Bf16::from_f32(x)).collect(),
    );
    let (kf, vf): (Vec<f32>, Vec<f32>) = (
        k.iter().map(|x| x.to_f32()).collect(),
        v.iter().map(|x| x.to_f32()).collect(),
    );
    let want = reference(&Problem {
        k: &kf,
        v: &vf,
        ..problem(&c)
    });
    let p = Problem {
        q: &c.q,
        k: &k,
        v: &v,
        table: &c.table,
        table_width: c.width,
        rows: &c.rows,
        seq_lens: &c.seq_lens,
        dims: c.dims,
        scale: 0.125,
        window: None,
        variant: Variant::default(),
    };
    let mut out = vec![0f32; c.q.len()];
    decode_attention(&p, &mut out, 2).unwrap();
    assert!(max_abs_diff(&out, &want) < 2e-5);
}

#[test]
fn raw_e4m3_loads_and_the_nan_check() {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::kernel::x86::{any_e4m3_nan, load16_raw, E4M3_RAW_SCALE};
        use std::arch::x86_64::*;
        if !(std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw"))
        {
            return;
        }
        let bytes: Vec<E4m3> = (0..=255u8).map(E4m3).collect();
        let mut got = [0f32; 16];
        for chunk in bytes.chunks(16) {
            // SAFETY: AVX-512F is present; 16 elements at the pointer.
            unsafe { _mm512_storeu_ps(got.as_mut_ptr(), load16_raw(chunk.as_ptr())) };
            for (g, x) in got.iter().zip(chunk) {
                if x.0 & 0x7f != 0x7f {
                    let want = x.to_f32();
                    assert_eq!(
                        (g * E4M3_RAW_SCALE).to_bits(),
                        want.to_bits(),
                        "byte {:#x}",
                        x.0
                    );
                }
            }
        }
        // the check finds either NaN byte at every offset of rows of 16, 48 and 128 bytes
        for d in [16usize, 48, 128] {
            for nan in [0x7fu8, 0xff] {
                for at in 0..d {
                    let clean = vec![0x7eu8; d];
                    let mut dirty = vec![0xfeu8; d];
                    dirty[at] = nan;
                    let rows = [clean.as_ptr(), dirty.as_ptr()];
                    // SAFETY: AVX-512F and BW are present; d bytes at each row.
                    unsafe {
                        assert!(any_e4m3_nan(&rows, d), "d {d} at {at}");
                        assert!(!any_e4m3_nan(&rows[..1], d));
                    }
                }
            }
        }
    }
}

/// An e4m3 NaN in the pool, on every path (full blocks of 16 keys and the tail): in V it
/// makes the heads that read it NaN; in K its score is NaN, which the softmax weighs as
/// ~1e-38 (`exp_nonpositive`), so the key drops out, as if the row did not attend it. The
/// other KV head is untouched either way. (Read as the finite 480 it would do neither.)
#[test]
fn an_e4m3_nan_in_the_pool_reaches_the_heads_that_read_it() {
    let dims = Dims::same(4, 2, 64);
    let len = 40; // two full blocks of 16 and a tail of 8
    let slot = dims.num_kv_heads * dims.head_dim;
    let mut rng = Rng(77);
    let q: Vec<f32> = (0..dims.num_heads * dims.head_dim)
        .map(|_| rng.unit())
        .collect();
    let run = |k: &[E4m3], v: &[E4m3], table: &[i32]| {
        let p = Problem {
            q: &q,
            k,
            v,
            table,
            table_width: table.len(),
            rows: &[0],
            seq_lens: &[table.len() as i64],
            dims,
            scale: 0.125,
            window: None,
            variant: Variant::default(),
        };
        let mut out = vec![0f32; q.len()];
        decode_attention(&p, &mut out, 1).unwrap();
        out
    };
    let all: Vec<i32> = (0..len as i32).collect();
    for (in_k, pos) in [(true, 3usize), (true, 35), (false, 20), (false, 39)] {
        let mut k: Vec<E4m3> = (0..len * slot)
            .map(|_| E4m3(finite_byte(&mut rng, &E4M3, 2.0)))
            .collect();
        let mut v = k.clone();
        let clean = run(&k, &v, &all);
        let without: Vec<i32> = all.iter().copied().filter(|&s| s != pos as i32).collect();
        let dropped = run(&k, &v, &without);
        let at = pos * slot + dims.head_dim + 5; // KV head 1, element 5 of position `pos`
        if in_k {
            k[at] = E4m3(0x7f);
        } else {
            v[at] = E4m3(0xff);
        }
        let out = run(&k, &v, &all);
        let group = dims.num_heads / dims.num_kv_heads;
        for (h, head) in out.chunks(dims.head_dim).enumerate() {
            let at = h * dims.head_dim..(h + 1) * dims.head_dim;
            let what = format!("k {in_k} pos {pos} head {h}");
            if h / group == 0 {
                assert_eq!(head, &clean[at], "{what}");
            } else if in_k {
                let diff = head.iter().zip(&dropped[at]).map(|(a, b)| (a - b).abs());
                assert!(diff.fold(0f32, f32::max) < 1e-6, "{what}");
            } else {
                assert!(head.iter().any(|x| x.is_nan()), "{what}");
            }
        }
    }
}
