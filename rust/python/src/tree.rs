//! `sglite._core.RadixTree`: the Python face of `tree_core::RadixTree`.

use numpy::PyArray1;
use pyo3::prelude::*;
use tree_core::radix_tree::check_ids;
use tree_core::{CompactId, EvictionPolicy, RadixTree};

use crate::convert::{as_int, as_size, core_err, index_ints, value_error, Arg};

/// Calls on at least this many tokens release the GIL while they run.
const GIL_FREE_TOKENS: usize = 4096;

/// Prefix cache index (token ids -> KV slots). Same contract as sglite.core.radix_tree.
#[pyclass(name = "RadixTree", module = "sglite._core")]
pub struct PyRadixTree {
    tree: RadixTree,
    /// Compact copies of long inputs, reused across calls: a call that releases the GIL must
    /// not read the caller's array, which another thread could then write.
    scratch_tokens: Vec<u32>,
    scratch_slots: Vec<u32>,
}

/// Copy ids into `buf` in the tree's compact form (ids it cannot hold become NO_TOKEN).
fn compact_into<'a>(buf: &'a mut Vec<u32>, ids: &[i64]) -> &'a [u32] {
    buf.clear();
    buf.extend(ids.iter().map(|&v| v.compact()));
    buf
}

fn policy_of(arg: &Arg<'_>) -> PyResult<EvictionPolicy> {
    let name = match arg {
        Arg::Default => return Ok(EvictionPolicy::Lru),
        Arg::Given(ob) => ob.extract::<String>().ok(),
    };
    name.as_deref()
        .and_then(EvictionPolicy::parse)
        .ok_or_else(|| {
            let shown = match arg {
                Arg::Given(ob) => ob.repr().map(|r| r.to_string()).unwrap_or_default(),
                Arg::Default => String::new(),
            };
            value_error(format!(
                "unknown eviction policy {shown}; choose one of: {}",
                EvictionPolicy::NAMES.join(", ")
            ))
        })
}

type Triple<'py> = (
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
);
type Copies<'py> = (Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<i64>>);
type HostMatch<'py> = (
    Bound<'py, PyArray1<i64>>,
    u64,
    Bound<'py, PyArray1<i64>>,
    u64,
);

fn slots_array(py: Python<'_>, slots: Vec<i64>) -> Bound<'_, PyArray1<i64>> {
    PyArray1::from_vec(py, slots)
}

#[pymethods]
impl PyRadixTree {
    #[new]
    #[pyo3(signature = (page_size = Arg::Default, eviction_policy = Arg::Default, host_slots = Arg::Default))]
    fn new(page_size: Arg<'_>, eviction_policy: Arg<'_>, host_slots: Arg<'_>) -> PyResult<Self> {
        let page_size = page_size.int_or(1, "page_size")?;
        if page_size < 1 {
            return Err(value_error(format!(
                "page_size must be >= 1, got {page_size}"
            )));
        }
        let policy = policy_of(&eviction_policy)?;
        let host_slots = host_slots.int_or(0, "host_slots")?;
        if host_slots < 0 {
            return Err(value_error(format!(
                "host_slots must be >= 0, got {host_slots}"
            )));
        }
        let tree = RadixTree::with_host(page_size, policy, host_slots).map_err(core_err)?;
        Ok(Self {
            tree,
            scratch_tokens: Vec::new(),
            scratch_slots: Vec::new(),
        })
    }

    #[getter]
    fn page_size(&self) -> usize {
        self.tree.page_size()
    }

    #[getter]
    fn eviction_policy(&self) -> &'static str {
        self.tree.eviction_policy().name()
    }

    /// Drop every node; ids keep counting so pre-reset ids become stale.
    fn reset(&mut self) {
        self.tree.reset();
    }

    /// Longest cached prefix in whole pages: (slots as int64 array, last matched node id).
    #[pyo3(signature = (tokens, extra_key = None))]
    fn match_prefix<'py>(
        &mut self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        extra_key: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyArray1<i64>>, u64)> {
        let tokens = index_ints(tokens, "tokens")?;
        let ns = crate::convert::extra_key(extra_key)?;
        let tree = &mut self.tree;
        let (slots, node_id) = if tokens.as_slice().len() >= GIL_FREE_TOKENS {
            let tokens = compact_into(&mut self.scratch_tokens, tokens.as_slice());
            py.allow_threads(|| tree.match_prefix(tokens, ns))
        } else {
            tree.match_prefix(tokens.as_slice(), ns)
        };
        Ok((slots_array(py, slots), node_id))
    }

    /// Insert the page-aligned prefix: (tokens already cached, last node id).
    #[pyo3(signature = (tokens, slots, extra_key = None, priority = Arg::Default))]
    fn insert(
        &mut self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
        extra_key: Option<&Bound<'_, PyAny>>,
        priority: Arg<'_>,
    ) -> PyResult<(usize, u64)> {
        let tokens = index_ints(tokens, "tokens")?;
        let slots = index_ints(slots, "slots")?;
        let (num_tokens, num_slots) = (tokens.as_slice().len(), slots.as_slice().len());
        if num_tokens != num_slots {
            return Err(value_error(format!(
                "tokens and slots differ in length ({num_tokens} vs {num_slots})"
            )));
        }
        let priority = priority.int_or(0, "priority")?;
        let ns = crate::convert::extra_key(extra_key)?;
        let tree = &mut self.tree;
        if num_tokens < GIL_FREE_TOKENS {
            return tree
                .insert(tokens.as_slice(), slots.as_slice(), ns, priority)
                .map_err(core_err);
        }
        // Check on the caller's values (the compact copy would hide what was out of range).
        check_ids(tokens.as_slice(), "tokens").map_err(core_err)?;
        check_ids(slots.as_slice(), "slots").map_err(core_err)?;
        let tokens = compact_into(&mut self.scratch_tokens, tokens.as_slice());
        let slots = compact_into(&mut self.scratch_slots, slots.as_slice());
        py.allow_threads(|| tree.insert(tokens, slots, ns, priority))
            .map_err(core_err)
    }

    fn lock(&mut self, node_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let node_id = as_int(node_id, "node_id")?;
        self.tree.lock(node_id).map_err(core_err)
    }

    fn unlock(&mut self, node_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let node_id = as_int(node_id, "node_id")?;
        self.tree.unlock(node_id).map_err(core_err)
    }

    /// Free unlocked leaves in policy order until num_tokens are freed; returns their slots.
    fn evict<'py>(
        &mut self,
        py: Python<'py>,
        num_tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let num_tokens = usize::try_from(as_size(num_tokens, "num_tokens")?).unwrap_or(usize::MAX);
        let tree = &mut self.tree;
        let freed = if num_tokens >= GIL_FREE_TOKENS {
            py.allow_threads(|| tree.evict(num_tokens))
        } else {
            tree.evict(num_tokens)
        };
        Ok(slots_array(py, freed))
    }

    /// Like evict, but candidates without a host copy get one first when the host has room:
    /// (freed device slots, device sources, host destinations); the caller copies src -> dst.
    fn evict_write_back<'py>(
        &mut self,
        py: Python<'py>,
        num_tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Triple<'py>> {
        let num_tokens = usize::try_from(as_size(num_tokens, "num_tokens")?).unwrap_or(usize::MAX);
        let (freed, src, dst) = self.tree.evict_write_back(num_tokens);
        Ok((
            slots_array(py, freed),
            slots_array(py, src),
            slots_array(py, dst),
        ))
    }

    /// Delete unlocked host-only leaves until num_tokens host tokens are freed; returns them.
    fn evict_host(&mut self, num_tokens: &Bound<'_, PyAny>) -> PyResult<usize> {
        let num_tokens = usize::try_from(as_size(num_tokens, "num_tokens")?).unwrap_or(usize::MAX);
        Ok(self.tree.evict_host(num_tokens))
    }

    /// (device slots, device node id, host slots, host node id): the device match, then its
    /// continuation through host-only nodes.
    #[pyo3(signature = (tokens, extra_key = None))]
    fn match_prefix_host<'py>(
        &mut self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        extra_key: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<HostMatch<'py>> {
        let tokens = index_ints(tokens, "tokens")?;
        let ns = crate::convert::extra_key(extra_key)?;
        let (device, device_node, host, host_node) =
            self.tree.match_prefix_host(tokens.as_slice(), ns);
        Ok((
            slots_array(py, device),
            device_node,
            slots_array(py, host),
            host_node,
        ))
    }

    /// Host copies for the device-resident nodes on root..node with hits >= min_hits:
    /// (device sources, host destinations); the caller copies src -> dst.
    fn backup<'py>(
        &mut self,
        py: Python<'py>,
        node_id: &Bound<'py, PyAny>,
        min_hits: &Bound<'py, PyAny>,
    ) -> PyResult<Copies<'py>> {
        let node_id = as_int(node_id, "node_id")?;
        let min_hits = as_int(min_hits, "min_hits")?;
        let (src, dst) = self.tree.backup(node_id, min_hits).map_err(core_err)?;
        Ok((slots_array(py, src), slots_array(py, dst)))
    }

    /// The host-only chain ending at host_node_id takes device_slots (root first).
    fn load_back(
        &mut self,
        host_node_id: &Bound<'_, PyAny>,
        device_slots: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let node_id = as_int(host_node_id, "host_node_id")?;
        let slots = index_ints(device_slots, "device_slots")?;
        self.tree
            .load_back(node_id, slots.as_slice())
            .map_err(core_err)
    }

    fn host_capacity(&self) -> usize {
        self.tree.host_capacity()
    }

    fn host_available_size(&self) -> usize {
        self.tree.host_available_size()
    }

    fn host_used_size(&self) -> usize {
        self.tree.host_used_size()
    }

    fn evictable_size(&self) -> usize {
        self.tree.evictable_size()
    }

    fn protected_size(&self) -> usize {
        self.tree.protected_size()
    }

    fn total_size(&self) -> usize {
        self.tree.total_size()
    }

    /// Number of nodes, not counting the root.
    fn node_count(&self) -> usize {
        self.tree.node_count()
    }

    /// Bytes held by the tree (node structs, token/slot storage, index maps, eviction order).
    fn memory_bytes(&self) -> usize {
        self.tree.memory_bytes()
    }

    /// Positions of node_ids in DFS-weight order (see the Python twin).
    fn dfs_weight_order(&self, node_ids: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
        let ids = node_ids
            .try_iter()?
            .map(|x| as_int(&x?, "node_ids[]"))
            .collect::<PyResult<Vec<i64>>>()?;
        self.tree.dfs_weight_order(&ids).map_err(core_err)
    }

    /// Raise RuntimeError on any broken invariant.
    fn sanity_check(&self) -> PyResult<()> {
        self.tree.sanity_check().map_err(core_err)
    }

    fn pretty_print(&self) -> String {
        self.tree.pretty_print()
    }

    fn __repr__(&self) -> String {
        format!(
            "RadixTree(page_size={}, eviction_policy='{}', nodes={}, tokens={})",
            self.tree.page_size(),
            self.tree.eviction_policy().name(),
            self.tree.node_count(),
            self.tree.total_size()
        )
    }
}
