//! The plan: task split, grouping of rows that share a cached prefix, one plan for many layers.

use super::*;
use crate::plan::split_tasks;

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
    let dims = Dims::same(2, 2, 4);
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
        window: None,
        variant: Variant::default(),
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
    let dims = Dims::same(6, 2, 64);
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

fn plan_of(p: &Problem<'_, f32>) -> DecodePlan {
    DecodePlan::new(
        p.table,
        p.table_width,
        p.rows,
        p.seq_lens,
        p.dims.num_kv_heads,
        p.window,
    )
    .unwrap()
}

#[test]
fn one_plan_serves_every_layer_and_checks_each() {
    let mut rng = Rng(2024);
    let dims = Dims::same(4, 2, 16);
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
            variant: Variant::default(),
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
        variant: Variant::default(),
    };
    let e = plan.run(&layer, &mut out, 2).unwrap_err();
    assert!(e.0.contains("outside the pool"), "{e}");
    let other = Dims::same(4, 4, 8);
    let layer = Layer {
        q: &c.q,
        k: &c.k,
        v: &c.v,
        dims: other,
        scale: 1.0,
        variant: Variant::default(),
    };
    assert!(plan
        .run(&layer, &mut out, 2)
        .unwrap_err()
        .0
        .contains("head layout"));
    assert!(out.iter().all(|&x| x == 7.0));
}
