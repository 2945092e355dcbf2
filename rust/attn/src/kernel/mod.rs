//! The inner loops: one task is one group of query rows (sharing a cached prefix, or a single
//! row) and one KV head.
//!
//! The head dimension is a compile-time constant in the common cases (64, 128) so that the
//! dot products and the value accumulation unroll into whole vector registers; other sizes
//! take the same code with a run-time length. Keys go in blocks of 16; the next block's rows
//! are prefetched (a row's slots are scattered over the pool, which the hardware prefetcher
//! cannot follow; without it a decode step at 16 x 1,150 tokens took 2x longer).

use crate::{exp, DecodePlan, Dims, Elem, KvElem, Layer, Variant};

mod isa;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

use isa::{Isa, Portable};

/// The output `[n, num_heads, v_dim]`; a (group, KV head) task writes its members' heads
/// of that KV head.
pub(crate) struct OutPtr<T>(pub *mut T);

impl<T> Clone for OutPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for OutPtr<T> {}

// SAFETY: threads write disjoint task ranges (see `run_tasks`).
unsafe impl<T: Send> Send for OutPtr<T> {}
unsafe impl<T: Send> Sync for OutPtr<T> {}

/// SAFETY: `plan.run` checked `p` and `out` against the plan; no other thread writes these
/// tasks.
/// `v_row`: the width of `p.v`'s rows (checked by `plan.run`).
pub(crate) unsafe fn run_tasks<T: Elem, K: KvElem>(
    plan: &DecodePlan,
    p: &Layer<'_, T, K>,
    v_row: usize,
    tasks: &[Task],
    out: OutPtr<T>,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::isa_cap::avx512()
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
        {
            // SAFETY: the CPU has AVX-512F and BW (checked just above).
            return run_avx512(plan, p, v_row, tasks, out);
        }
        if crate::isa_cap::avx2()
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
            return run_avx2(plan, p, v_row, tasks, out);
        }
    }
    dispatch_dim(plan, p, v_row, tasks, out, Portable)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn run_avx512<T: Elem, K: KvElem>(
    plan: &DecodePlan,
    p: &Layer<'_, T, K>,
    v_row: usize,
    tasks: &[Task],
    out: OutPtr<T>,
) {
    dispatch_dim(plan, p, v_row, tasks, out, x86::Avx512)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_avx2<T: Elem, K: KvElem>(
    plan: &DecodePlan,
    p: &Layer<'_, T, K>,
    v_row: usize,
    tasks: &[Task],
    out: OutPtr<T>,
) {
    dispatch_dim(plan, p, v_row, tasks, out, x86::Avx2)
}

/// SAFETY: as `run_tasks`, and the CPU has the features `isa` needs.
#[inline(always)]
unsafe fn dispatch_dim<T: Elem, K: KvElem, I: Isa>(
    plan: &DecodePlan,
    p: &Layer<'_, T, K>,
    v_row: usize,
    tasks: &[Task],
    out: OutPtr<T>,
    isa: I,
) {
    let dims = (p.dims.head_dim, p.dims.v_dim);
    match dims {
        (64, 64) => run_body(plan, p, v_row, tasks, out, (Fixed::<64>, Fixed::<64>), isa),
        (128, 128) => run_body(
            plan,
            p,
            v_row,
            tasks,
            out,
            (Fixed::<128>, Fixed::<128>),
            isa,
        ),
        (d, dv) => run_body(plan, p, v_row, tasks, out, (Any(d), Any(dv)), isa),
    }
}

/// The head dimension: a constant the compiler unrolls, or a run-time value.
trait HeadDim: Copy {
    fn get(self) -> usize;
}

#[derive(Clone, Copy)]
struct Fixed<const D: usize>;

impl<const D: usize> HeadDim for Fixed<D> {
    #[inline(always)]
    fn get(self) -> usize {
        D
    }
}

#[derive(Clone, Copy)]
struct Any(usize);

impl HeadDim for Any {
    #[inline(always)]
    fn get(self) -> usize {
        self.0
    }
}

#[inline(always)]
fn prefetch<T>(row: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = std::mem::size_of_val(row);
        let base = row.as_ptr() as *const i8;
        let mut at = 0;
        while at < bytes {
            // SAFETY: prefetch never faults; the address is inside `row`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(base.add(at)) };
            at += 64;
        }
    }
}

/// Rows that attend together: `members` (query indices) share the slots of their first
/// `shared` positions (a cached prefix), whose K/V rows are then read once for all of them.
pub(crate) struct Group {
    pub members: Vec<usize>,
    pub shared: usize,
}

/// One unit of work: a group and a KV head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Task {
    pub group: u32,
    pub head: u32,
}

/// Keys per block: the scores of a block come out of one vector register (16 f32 lanes).
const BLOCK: usize = 16;

/// Addresses of the K (or V) rows of head `h` at `slots`, in a buffer of `row`-element rows
/// of which `d` are read. The slots were validated against the pool, so every address holds
/// `d` elements.
#[inline(always)]
fn row_ptrs<T>(
    buf: &[T],
    slots: &[i32],
    h: usize,
    kv_heads: usize,
    (row, d): (usize, usize),
    out: &mut [*const T],
) {
    for (o, &slot) in out.iter_mut().zip(slots) {
        *o = buf[(slot as usize * kv_heads + h) * row..][..d].as_ptr();
    }
}

/// `v_row`: the width of `p.v`'s rows (the first `v_dim` of each are the values); `(dim,
/// v_dim)`: the key and value head widths (constants in the common cases).
/// SAFETY: as `run_tasks`, and the CPU has the features `isa` needs.
#[inline(always)]
unsafe fn run_body<T: Elem, K: KvElem, H: HeadDim, V: HeadDim, I: Isa>(
    plan: &DecodePlan,
    p: &Layer<'_, T, K>,
    v_row: usize,
    tasks: &[Task],
    out: OutPtr<T>,
    (dim, v_dim): (H, V),
    isa: I,
) {
    let Dims {
        num_heads,
        num_kv_heads,
        ..
    } = p.dims;
    let (d, dv) = (dim.get(), v_dim.get());
    let per_kv = num_heads / num_kv_heads; // query heads per KV head
    let task_len = per_kv * d;
    let out_len = per_kv * dv;
    let mut q: Vec<f32> = Vec::new();
    let mut acc: Vec<f32> = Vec::new();
    let mut sums: Vec<f32> = Vec::new();
    let mut scores: Vec<f32> = Vec::new();
    let mut offsets: Vec<usize> = Vec::new();
    let mut ptrs = [std::ptr::null::<K>(); BLOCK];
    for task in tasks {
        let Group { members, shared } = &plan.groups[task.group as usize];
        let (h, shared) = (task.head as usize, *shared);
        let lead = plan.slots(members[0]);
        let walk = Walk {
            lead,
            shared,
            members,
            plan,
            kv_heads: num_kv_heads,
        };
        // this head's queries of every member, scaled; score rows: member m, query head j
        q.clear();
        offsets.clear();
        let mut total = 0;
        let raw = isa.raw_scale::<K>(); // a power of two: the scalings are exact
        let q_scale = p.scale * raw;
        for &i in members {
            let at = (i * num_kv_heads + h) * task_len;
            q.extend(p.q[at..at + task_len].iter().map(|x| x.to_f32() * q_scale));
            offsets.push(total);
            total += per_kv * plan.slots(i).len();
        }
        scores.clear();
        scores.resize(total, 0.0);
        // scores: each block of the shared prefix once for all members, then each member's own
        for_each_block(
            p.k,
            (d, d),
            h,
            &walk,
            &mut ptrs,
            |members_in, block, end, keys| {
                for m in members_in {
                    let len = plan.slots(members[m]).len();
                    for j in 0..per_kv {
                        let qj = &q[(m * per_kv + j) * d..][..d];
                        let row = &mut scores[offsets[m] + j * len..][..len];
                        isa.scores(qj, keys, &mut row[block..end], d);
                    }
                }
            },
        );
        sums.clear();
        let Variant { logit_cap, sinks } = p.variant;
        for (m, &i) in members.iter().enumerate() {
            let len = plan.slots(i).len();
            for j in 0..per_kv {
                let row = &mut scores[offsets[m] + j * len..][..len];
                if logit_cap > 0.0 {
                    exp::soft_cap(row, logit_cap);
                }
                let sink = sinks.map(|s| s[h * per_kv + j]);
                sums.push(exp::softmax_numerators(row, sink));
            }
        }
        acc.clear();
        acc.resize(members.len() * out_len, 0.0);
        for_each_block(
            p.v,
            (v_row, dv),
            h,
            &walk,
            &mut ptrs,
            |members_in, block, end, values| {
                for m in members_in {
                    let len = plan.slots(members[m]).len();
                    for j in 0..per_kv {
                        let acc_j = &mut acc[(m * per_kv + j) * dv..][..dv];
                        let row = &scores[offsets[m] + j * len..][..len];
                        isa.weighted_sum(acc_j, &row[block..end], values, dv);
                    }
                }
            },
        );
        for (m, &i) in members.iter().enumerate() {
            let at = (i * num_kv_heads + h) * out_len;
            let out = std::slice::from_raw_parts_mut(out.0.add(at), out_len);
            let acc_m = &acc[m * out_len..][..out_len];
            for (j, (o, a)) in out
                .chunks_exact_mut(dv)
                .zip(acc_m.chunks_exact(dv))
                .enumerate()
            {
                let inv = raw / sums[m * per_kv + j];
                for (o, a) in o.iter_mut().zip(a) {
                    *o = T::from_f32(a * inv);
                }
            }
        }
    }
}

/// The keys a group reads: positions `0..shared` of `lead` for all members at once, then
/// each member's own `shared..len`.
struct Walk<'a> {
    lead: &'a [i32],
    shared: usize,
    members: &'a [usize],
    plan: &'a DecodePlan,
    kv_heads: usize,
}

/// Calls `visit(members, from, to, rows)` for each block of keys of `plan` with the addresses
/// of their rows of head `h` in `buf` (K or V, rows of `row` elements of which `d` are read:
/// `(row, d)`); prefetches the next block first.
#[inline(always)]
fn for_each_block<T, V>(
    buf: &[T],
    (row, d): (usize, usize),
    h: usize,
    walk: &Walk<'_>,
    ptrs: &mut [*const T; BLOCK],
    mut visit: V,
) where
    V: FnMut(std::ops::Range<usize>, usize, usize, &[*const T]),
{
    let kv_heads = walk.kv_heads;
    let common = (walk.shared > 0).then_some((0..walk.members.len(), walk.lead, 0, walk.shared));
    let own = walk.members.iter().enumerate().map(|(m, &i)| {
        let slots = walk.plan.slots(i);
        (m..m + 1, slots, walk.shared, slots.len())
    });
    for (members, slots, from, to) in common.into_iter().chain(own) {
        for block in (from..to).step_by(BLOCK) {
            let end = (block + BLOCK).min(to);
            for &slot in &slots[end..(end + BLOCK).min(to)] {
                prefetch(&buf[(slot as usize * kv_heads + h) * row..][..d]);
            }
            let rows = &mut ptrs[..end - block];
            row_ptrs(buf, &slots[block..end], h, kv_heads, (row, d), rows);
            visit(members.clone(), block, end, rows);
        }
    }
}
