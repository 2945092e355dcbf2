//! `sglite._core.PrefillBudget` and `AddReqResult`: the Python face of `tree_core::budget`.

use pyo3::prelude::*;
use pyo3::types::PyFloat;
use tree_core::{AddReqResult, PrefillBudget};

use crate::convert::{as_size, core_err, index_ints, value_error, Arg};

/// Verdicts of the admission budget (plain ints, as in the Python twin).
#[pyclass(name = "AddReqResult", module = "sglite._core", frozen)]
pub struct PyAddReqResult;

#[pymethods]
impl PyAddReqResult {
    #[classattr]
    const CONTINUE: u8 = AddReqResult::Continue as u8;
    #[classattr]
    const NO_TOKEN: u8 = AddReqResult::NoToken as u8;
    #[classattr]
    const OTHER: u8 = AddReqResult::Other as u8;
}

/// Admission budget of one prefill batch. Same API as sglite.core.budget.PrefillBudget.
#[pyclass(name = "PrefillBudget", module = "sglite._core")]
pub struct PyPrefillBudget {
    inner: PrefillBudget,
}

#[pymethods]
impl PyPrefillBudget {
    #[new]
    #[pyo3(signature = (page_size, rem_input_tokens, rem_chunk_tokens = None, num_mixed_decode_tokens = Arg::Default))]
    fn new(
        page_size: &Bound<'_, PyAny>,
        rem_input_tokens: &Bound<'_, PyAny>,
        rem_chunk_tokens: Option<&Bound<'_, PyAny>>,
        num_mixed_decode_tokens: Arg<'_>,
    ) -> PyResult<Self> {
        let page_size = crate::convert::as_int(page_size, "page_size")?;
        if page_size < 1 {
            return Err(value_error(format!(
                "page_size must be >= 1, got {page_size}"
            )));
        }
        let mixed = match &num_mixed_decode_tokens {
            Arg::Default => 0,
            Arg::Given(ob) => as_size(ob, "num_mixed_decode_tokens")?,
        };
        let rem_input = as_size(rem_input_tokens, "rem_input_tokens")?;
        let rem_chunk = match rem_chunk_tokens {
            None => None,
            Some(ob) => Some(as_size(ob, "rem_chunk_tokens")?),
        };
        let inner = PrefillBudget::new(page_size, rem_input, rem_chunk, mixed).map_err(core_err)?;
        Ok(Self { inner })
    }

    /// The largest max_new_tokens with which add_req admits a prompt of `prompt_len` tokens
    /// into an idle pool of `capacity` tokens (capacity - page_size - prompt_len - 1).
    #[staticmethod]
    fn max_new_tokens_limit(
        capacity: &Bound<'_, PyAny>,
        page_size: &Bound<'_, PyAny>,
        prompt_len: &Bound<'_, PyAny>,
    ) -> PyResult<i128> {
        // Converted in the Python twin's order, so the first bad argument is the one named.
        let capacity = as_size(capacity, "capacity")?;
        let page_size = crate::convert::as_int(page_size, "page_size")?;
        if page_size < 1 {
            return Err(value_error(format!(
                "page_size must be >= 1, got {page_size}"
            )));
        }
        let prompt_len = as_size(prompt_len, "prompt_len")?;
        PrefillBudget::max_new_tokens_limit(capacity, page_size, prompt_len).map_err(core_err)
    }

    #[getter]
    fn total_offset(&self) -> i128 {
        self.inner.total_offset()
    }

    #[getter]
    fn current_offset(&self) -> i128 {
        self.inner.current_offset()
    }

    #[getter]
    fn rem_input_tokens(&self) -> i128 {
        self.inner.rem_input_tokens()
    }

    #[getter]
    fn rem_chunk_tokens(&self) -> Option<i128> {
        self.inner.rem_chunk_tokens()
    }

    #[getter]
    fn num_admitted(&self) -> u64 {
        self.inner.num_admitted()
    }

    /// Charge the running batch; returns the tokens reserved.
    fn reserve_running(
        &mut self,
        remaining_new_tokens: &Bound<'_, PyAny>,
        ignore_eos: &Bound<'_, PyAny>,
        new_token_ratio: &Bound<'_, PyAny>,
    ) -> PyResult<i128> {
        let remaining = index_ints(remaining_new_tokens, "remaining_new_tokens")?;
        let remaining = remaining.as_slice();
        let flags = ignore_eos
            .try_iter()?
            .map(|f| f?.is_truthy())
            .collect::<PyResult<Vec<bool>>>()?;
        if flags.len() != remaining.len() {
            return Err(value_error(format!(
                "remaining_new_tokens and ignore_eos differ in length ({} vs {})",
                remaining.len(),
                flags.len()
            )));
        }
        // float(x), like the Python twin (accepts ints, numpy scalars, numeric strings).
        let py = new_token_ratio.py();
        let ratio: f64 = py
            .get_type::<PyFloat>()
            .call1((new_token_ratio,))?
            .extract()?;
        self.inner
            .reserve_running(remaining, &flags, ratio)
            .map_err(core_err)
    }

    /// The verdict for the next candidate: CONTINUE, NO_TOKEN or OTHER.
    fn state(&self, available: &Bound<'_, PyAny>) -> PyResult<u8> {
        let available = as_size(available, "available")?;
        Ok(self.inner.state(available).map_err(core_err)? as u8)
    }

    /// Charge a new request: (admitted, state for the next one, granted extend length).
    fn add_req(
        &mut self,
        available: &Bound<'_, PyAny>,
        prefix_len: &Bound<'_, PyAny>,
        extend_len: &Bound<'_, PyAny>,
        max_new_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<(bool, u8, i128)> {
        let available = as_size(available, "available")?;
        let prefix_len = as_size(prefix_len, "prefix_len")?;
        let extend_len = as_size(extend_len, "extend_len")?;
        if extend_len < 1 {
            return Err(value_error(
                "extend_len must be >= 1: every admitted request computes a token",
            ));
        }
        let max_new = as_size(max_new_tokens, "max_new_tokens")?;
        let (admitted, state, granted) = self
            .inner
            .add_req(available, prefix_len, extend_len, max_new)
            .map_err(core_err)?;
        Ok((admitted, state as u8, granted))
    }

    /// The tokens `available` lacks for add_req to admit this request now (0 when it fits).
    fn shortfall(
        &self,
        available: &Bound<'_, PyAny>,
        extend_len: &Bound<'_, PyAny>,
        max_new_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<i128> {
        let available = as_size(available, "available")?;
        let extend_len = as_size(extend_len, "extend_len")?;
        if extend_len < 1 {
            return Err(value_error(
                "extend_len must be >= 1: every admitted request computes a token",
            ));
        }
        let max_new = as_size(max_new_tokens, "max_new_tokens")?;
        self.inner
            .shortfall(available, extend_len, max_new)
            .map_err(core_err)
    }

    /// The tokens a request needs free now for its whole life to fit (charges nothing).
    fn whole_life_need(
        &self,
        extend_len: &Bound<'_, PyAny>,
        max_new_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<i128> {
        let extend_len = as_size(extend_len, "extend_len")?;
        if extend_len < 1 {
            return Err(value_error(
                "extend_len must be >= 1: every admitted request computes a token",
            ));
        }
        let max_new = as_size(max_new_tokens, "max_new_tokens")?;
        self.inner
            .whole_life_need(extend_len, max_new)
            .map_err(core_err)
    }

    /// Admit a request the memory rule refused when its whole life fits: (admitted, state, granted).
    fn add_req_whole_life(
        &mut self,
        available: &Bound<'_, PyAny>,
        prefix_len: &Bound<'_, PyAny>,
        extend_len: &Bound<'_, PyAny>,
        max_new_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<(bool, u8, i128)> {
        let available = as_size(available, "available")?;
        let prefix_len = as_size(prefix_len, "prefix_len")?;
        let extend_len = as_size(extend_len, "extend_len")?;
        if extend_len < 1 {
            return Err(value_error(
                "extend_len must be >= 1: every admitted request computes a token",
            ));
        }
        let max_new = as_size(max_new_tokens, "max_new_tokens")?;
        let (admitted, state, granted) = self
            .inner
            .add_req_whole_life(available, prefix_len, extend_len, max_new)
            .map_err(core_err)?;
        Ok((admitted, state as u8, granted))
    }

    /// Charge the next slice of the request being chunked: (state for the next one, granted).
    fn add_chunk(
        &mut self,
        available: &Bound<'_, PyAny>,
        prefix_len: &Bound<'_, PyAny>,
        remaining_len: &Bound<'_, PyAny>,
        max_new_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<(u8, i128)> {
        let available = as_size(available, "available")?;
        let prefix_len = as_size(prefix_len, "prefix_len")?;
        let remaining_len = as_size(remaining_len, "remaining_len")?;
        if remaining_len < 1 {
            return Err(value_error("remaining_len must be >= 1"));
        }
        if self.inner.rem_chunk_tokens().is_none() {
            return Err(value_error(
                "add_chunk needs a chunk budget (rem_chunk_tokens is None)",
            ));
        }
        let max_new = as_size(max_new_tokens, "max_new_tokens")?;
        let (state, granted) = self
            .inner
            .add_chunk(available, prefix_len, remaining_len, max_new)
            .map_err(core_err)?;
        Ok((state as u8, granted))
    }
}
