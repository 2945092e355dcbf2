//! `sglite._core`: PyO3 bindings of the Rust tree core (radix tree, page allocator, budget)
//! and of the CPU kernels: decode attention (`DecodePlan`) and the decoder layer's fused
//! element-wise steps (`rms_norm`, `gated_mul`, `rope`) and the K/V writes (`kv_store`).
//!
//! Same classes, methods, results and exceptions as the Python twin in `sglite.core`; bad
//! arguments raise ValueError, unlock of an unlocked node, free-group misuse and broken
//! invariants raise RuntimeError. Index buffers cross as lists or 1-D integer numpy arrays and
//! come back as 1-D int64 arrays; long calls release the GIL.

mod allocator;
mod attn;
mod budget;
mod convert;
mod ops;
mod quant;
mod step;
mod tree;

use pyo3::prelude::*;
use pyo3::types::PyTuple;
use tree_core::{EvictionPolicy, CLIP_MAX_NEW_TOKENS, MAX_PAGE_SIZE};

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("CLIP_MAX_NEW_TOKENS", CLIP_MAX_NEW_TOKENS)?;
    m.add("MAX_PAGE_SIZE", MAX_PAGE_SIZE)?;
    m.add(
        "SUPPORTED_EVICTION_POLICIES",
        PyTuple::new(m.py(), EvictionPolicy::NAMES)?,
    )?;
    m.add_class::<tree::PyRadixTree>()?;
    m.add_class::<allocator::PyPageAllocator>()?;
    m.add_class::<budget::PyPrefillBudget>()?;
    m.add_class::<budget::PyAddReqResult>()?;
    m.add_class::<attn::PyDecodePlan>()?;
    m.add_class::<step::PyDecodeStep>()?;
    m.add_function(wrap_pyfunction!(attn::set_openmp_parallel, m)?)?;
    m.add_function(wrap_pyfunction!(attn::team_solo_spells, m)?)?;
    m.add_function(wrap_pyfunction!(ops::rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(ops::gated_mul, m)?)?;
    m.add_function(wrap_pyfunction!(ops::rope, m)?)?;
    m.add_function(wrap_pyfunction!(ops::kv_store, m)?)?;
    quant::register(m)?;
    Ok(())
}
