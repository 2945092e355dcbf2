//! `DecodePlan`: a decode batch's rows, groups and tasks, built once per forward pass and
//! run for every layer (the tasks cut into one range per thread).

use crate::{err, kernel, pool, AttnError, Dims, Elem, KvElem, Layer, Variant};

/// Below this much work a second thread costs more than it saves. Work: per (key, KV head)
/// pair, its K and V elements read plus the multiply-adds of the query heads that share
/// them, `(head_dim + v_dim) * (1 + heads per KV head)`. Measured on 2 cores (one row,
/// torch's OpenMP team): one thread is as fast at ~300K, SmolLM2's shape at 190 keys or a
/// 7B's (32 heads of 128, no grouping) at 18; the 7B at 160 keys took 96 us on one thread
/// and 45 on two (a threshold of 8192 pairs had kept it on one).
const MIN_PARALLEL_WORK: usize = 300_000;

/// The layer-independent part of a decode batch's attention, built once per forward pass:
/// each row's slots (copied from the request table and checked), the groups of rows that share
/// a cached prefix, and the tasks (a group and a KV head) with their costs.
pub struct DecodePlan {
    slots: Vec<i32>,
    starts: Vec<usize>, // row i's slots: slots[starts[i]..starts[i + 1]]
    num_kv_heads: usize,
    pub(crate) groups: Vec<kernel::Group>,
    tasks: Vec<kernel::Task>,
    costs: Vec<usize>,
    largest_slot: Option<(i32, usize)>, // (slot, its row), for the pool-size check
}

impl DecodePlan {
    /// Query row i attends to the slots `table[rows[i], 0 .. seq_lens[i]]` (table
    /// `[table_rows, table_width]`), or to the last `window` of them.
    pub fn new(
        table: &[i32],
        table_width: usize,
        rows: &[i64],
        seq_lens: &[i64],
        num_kv_heads: usize,
        window: Option<usize>,
    ) -> Result<Self, AttnError> {
        if num_kv_heads == 0 {
            return err("num_kv_heads must be >= 1".to_owned());
        }
        if window == Some(0) {
            return err("window must be >= 1 (None: no window)".to_owned());
        }
        let window = window.unwrap_or(usize::MAX);
        if rows.len() != seq_lens.len() {
            return err(format!(
                "{} rows but {} seq_lens",
                rows.len(),
                seq_lens.len()
            ));
        }
        if table_width == 0 || !table.len().is_multiple_of(table_width) {
            return err(format!(
                "table of {} entries is not [rows, {table_width}]",
                table.len()
            ));
        }
        let table_rows = table.len() / table_width;
        let kept = |len: i64| (len.max(0) as usize).min(window);
        let mut slots = Vec::with_capacity(seq_lens.iter().map(|&l| kept(l)).sum());
        let mut starts = vec![0];
        let mut largest_slot: Option<(i32, usize)> = None;
        for (&row, &len) in rows.iter().zip(seq_lens) {
            if row < 0 || row as usize >= table_rows {
                return err(format!(
                    "row {row} is outside the table's {table_rows} rows"
                ));
            }
            if len < 1 || len as usize > table_width {
                return err(format!("seq_len {len} is outside 1..={table_width}"));
            }
            let end = row as usize * table_width + len as usize;
            let own = &table[end - kept(len)..end];
            if let Some(bad) = own.iter().find(|&&s| s < 0) {
                return err(format!("slot {bad} of row {row} is outside the pool"));
            }
            let top = own.iter().copied().max().unwrap_or(0);
            if largest_slot.is_none_or(|(s, _)| top > s) {
                largest_slot = Some((top, row as usize));
            }
            slots.extend_from_slice(own);
            starts.push(slots.len());
        }
        let slots_of = |i: usize| &slots[starts[i]..starts[i + 1]];
        let groups = make_groups(rows.len(), slots_of);
        let mut tasks = Vec::with_capacity(groups.len() * num_kv_heads);
        let mut costs = Vec::with_capacity(tasks.capacity());
        for (g, group) in groups.iter().enumerate() {
            let cost: usize = group.members.iter().map(|&i| slots_of(i).len()).sum();
            for head in 0..num_kv_heads {
                tasks.push(kernel::Task {
                    group: g as u32,
                    head: head as u32,
                });
                costs.push(cost);
            }
        }
        Ok(Self {
            slots,
            starts,
            num_kv_heads,
            groups,
            tasks,
            costs,
            largest_slot,
        })
    }

    pub fn num_rows(&self) -> usize {
        self.starts.len() - 1
    }

    /// Row i's slots.
    pub(crate) fn slots(&self, i: usize) -> &[i32] {
        &self.slots[self.starts[i]..self.starts[i + 1]]
    }

    /// One layer: writes `out` (`[n, num_heads, v_dim]`) from `layer`'s q and pool.
    pub fn run<T: Elem, K: KvElem>(
        &self,
        layer: &Layer<'_, T, K>,
        out: &mut [T],
        num_threads: usize,
    ) -> Result<(), AttnError> {
        let v_row = self.check(layer, out.len())?;
        let d = &layer.dims;
        let per_pair = (d.head_dim + d.v_dim) * (1 + d.num_heads / d.num_kv_heads.max(1));
        let threads = if self.costs.iter().sum::<usize>() * per_pair < MIN_PARALLEL_WORK {
            1
        } else {
            num_threads.max(1)
        };
        let cuts = split_tasks(&self.costs, threads);
        let out = kernel::OutPtr(out.as_mut_ptr());
        pool::for_each(cuts.len() - 1, threads, &|i| {
            let mine = &self.tasks[cuts[i]..cuts[i + 1]];
            // SAFETY: `check` made sure `out` holds every row's output and every slot is in
            // the pool; each (row, KV head) is in exactly one task and each range is run
            // once, so no two threads write the same element.
            unsafe { kernel::run_tasks(self, layer, v_row, mine, out) }
        });
        Ok(())
    }

    /// Checks the layer against the plan; returns the width of `v`'s rows.
    fn check<T, K>(&self, layer: &Layer<'_, T, K>, out_len: usize) -> Result<usize, AttnError> {
        let Dims {
            num_heads,
            num_kv_heads,
            head_dim,
            v_dim,
        } = layer.dims;
        let Variant { logit_cap, sinks } = layer.variant;
        if !(logit_cap.is_finite() && logit_cap >= 0.0) {
            return err(format!(
                "logit_cap must be finite and >= 0, got {logit_cap}"
            ));
        }
        if let Some(sinks) = sinks {
            if sinks.len() != num_heads {
                return err(format!(
                    "{} sinks for {num_heads} query heads; one per head",
                    sinks.len()
                ));
            }
        }
        if num_kv_heads != self.num_kv_heads
            || head_dim == 0
            || !num_heads.is_multiple_of(num_kv_heads)
        {
            return err(format!(
                "bad head layout: {num_heads} query heads, {num_kv_heads} KV heads (the plan's: \
                 {}), head_dim {head_dim}",
                self.num_kv_heads
            ));
        }
        if v_dim == 0 || v_dim > head_dim {
            return err(format!(
                "v_dim {v_dim} must be in 1..={head_dim} (head_dim)"
            ));
        }
        let n = self.num_rows();
        let q_len = n * num_heads * head_dim;
        let out_want = n * num_heads * v_dim;
        if layer.q.len() != q_len || out_len != out_want {
            return err(format!(
                "q has {} and out {out_len} elements; [{n}, {num_heads}, {head_dim}] and \
                 [{n}, {num_heads}, {v_dim}] need {q_len} and {out_want}",
                layer.q.len()
            ));
        }
        let slot_len = num_kv_heads * head_dim;
        let num_slots = layer.k.len() / slot_len;
        let v_slot = layer.v.len().checked_div(num_slots).unwrap_or(0);
        if !layer.k.len().is_multiple_of(slot_len)
            || num_slots * v_slot != layer.v.len()
            || !v_slot.is_multiple_of(num_kv_heads)
            || v_slot / num_kv_heads < v_dim
        {
            return err(format!(
                "k has {} and v {} elements; k must be [num_slots, {num_kv_heads}, {head_dim}] \
                 and v [num_slots, {num_kv_heads}, >= {v_dim}]",
                layer.k.len(),
                layer.v.len()
            ));
        }
        if let Some((slot, row)) = self.largest_slot {
            if slot as usize >= num_slots {
                return err(format!(
                    "slot {slot} of row {row} is outside the pool's {num_slots} slots"
                ));
            }
        }
        Ok(v_slot / num_kv_heads)
    }
}

/// Most rows in one group (their scores must stay in the core's cache).
const MAX_GROUP: usize = 16;
/// The shortest shared prefix worth reading once for several rows.
const MIN_SHARED: usize = 16;

/// Rows grouped by shared prefix: rows starting at the same slot whose slot lists agree on
/// at least `MIN_SHARED` positions form a group (its `shared` is the common length); every
/// other row is a group of its own (`shared` 0).
fn make_groups<'a>(n: usize, slots_of: impl Fn(usize) -> &'a [i32]) -> Vec<kernel::Group> {
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| (slots_of(i)[0], i));
    let mut groups = Vec::new();
    let mut at = 0;
    while at < order.len() {
        let lead = slots_of(order[at]);
        let (mut end, mut shared) = (at + 1, lead.len());
        while end < order.len() && end - at < MAX_GROUP {
            let other = slots_of(order[end]);
            let common = lead.iter().zip(other).take_while(|(a, b)| a == b).count();
            if common.min(shared) < MIN_SHARED {
                break;
            }
            shared = shared.min(common);
            end += 1;
        }
        let shared = if end - at > 1 { shared } else { 0 };
        groups.push(kernel::Group {
            members: order[at..end].to_vec(),
            shared,
        });
        at = end;
    }
    groups
}

/// Boundaries `[0, .., costs.len()]` of at most `threads` contiguous ranges of about equal cost.
pub(crate) fn split_tasks(costs: &[usize], threads: usize) -> Vec<usize> {
    let total: usize = costs.iter().sum();
    let mut cuts = vec![0];
    let mut done = 0usize;
    for (task, cost) in costs.iter().enumerate() {
        done += cost;
        let next = cuts.len();
        if next < threads && done * threads >= total * next && task + 1 < costs.len() {
            cuts.push(task + 1);
        }
    }
    cuts.push(costs.len());
    cuts
}
