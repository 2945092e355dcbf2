//! `sglite._core.PageAllocator`: the Python face of `tree_core::PageAllocator`.

use numpy::PyArray1;
use pyo3::prelude::*;
use tree_core::PageAllocator;

use crate::convert::{as_size, core_err, index_ints, value_error, Arg};

/// Free-page bookkeeping of the KV pool. Same contract as sglite.core.page_allocator.
#[pyclass(name = "PageAllocator", module = "sglite._core")]
pub struct PyPageAllocator {
    inner: PageAllocator,
}

fn array_or_none(py: Python<'_>, slots: Option<Vec<i64>>) -> Option<Bound<'_, PyArray1<i64>>> {
    slots.map(|s| PyArray1::from_vec(py, s))
}

#[pymethods]
impl PyPageAllocator {
    #[new]
    #[pyo3(signature = (num_slots, page_size = Arg::Default))]
    fn new(num_slots: &Bound<'_, PyAny>, page_size: Arg<'_>) -> PyResult<Self> {
        let page_size = page_size.int_or(1, "page_size")?;
        if page_size < 1 {
            return Err(value_error(format!(
                "page_size must be >= 1, got {page_size}"
            )));
        }
        let num_slots = as_size(num_slots, "num_slots")?;
        let inner = PageAllocator::new(num_slots, page_size).map_err(core_err)?;
        Ok(Self { inner })
    }

    #[getter]
    fn page_size(&self) -> usize {
        self.inner.page_size()
    }

    #[getter]
    fn num_pages(&self) -> usize {
        self.inner.num_pages()
    }

    /// Usable slots (whole pages only).
    fn capacity(&self) -> usize {
        self.inner.capacity()
    }

    fn available_size(&self) -> usize {
        self.inner.available_size()
    }

    fn alloc<'py>(
        &mut self,
        py: Python<'py>,
        num_tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyArray1<i64>>>> {
        let num_tokens = usize::try_from(as_size(num_tokens, "num_tokens")?).unwrap_or(usize::MAX);
        let slots = self.inner.alloc(num_tokens).map_err(core_err)?;
        Ok(array_or_none(py, slots))
    }

    fn free(&mut self, slots: &Bound<'_, PyAny>) -> PyResult<()> {
        let slots = index_ints(slots, "slots")?;
        self.inner.free(slots.as_slice()).map_err(core_err)
    }

    fn free_group_begin(&mut self) -> PyResult<()> {
        self.inner.free_group_begin().map_err(core_err)
    }

    fn free_group_end(&mut self) -> PyResult<()> {
        self.inner.free_group_end().map_err(core_err)
    }

    fn alloc_extend<'py>(
        &mut self,
        py: Python<'py>,
        prefix_lens: &Bound<'py, PyAny>,
        seq_lens: &Bound<'py, PyAny>,
        last_locs: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyArray1<i64>>>> {
        let prefix = index_ints(prefix_lens, "prefix_lens")?;
        let seq = index_ints(seq_lens, "seq_lens")?;
        let last = index_ints(last_locs, "last_locs")?;
        let slots = self
            .inner
            .alloc_extend(prefix.as_slice(), seq.as_slice(), last.as_slice())
            .map_err(core_err)?;
        Ok(array_or_none(py, slots))
    }

    fn alloc_decode<'py>(
        &mut self,
        py: Python<'py>,
        seq_lens: &Bound<'py, PyAny>,
        last_locs: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyArray1<i64>>>> {
        let seq = index_ints(seq_lens, "seq_lens")?;
        if seq.as_slice().iter().any(|&s| s < 1) {
            return Err(value_error(
                "seq_lens of alloc_decode count the new token and must be >= 1",
            ));
        }
        let last = index_ints(last_locs, "last_locs")?;
        let slots = self
            .inner
            .alloc_decode(seq.as_slice(), last.as_slice())
            .map_err(core_err)?;
        Ok(array_or_none(py, slots))
    }

    fn __repr__(&self) -> String {
        format!(
            "PageAllocator(capacity={}, page_size={}, available={})",
            self.inner.capacity(),
            self.inner.page_size(),
            self.inner.available_size()
        )
    }
}
