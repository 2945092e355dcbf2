//! Argument conversion at the Python boundary: ints, index buffers, namespaces, errors.
//!
//! Mirrors `python/sglite/core/_arrays.py`: token ids and slots come as lists of ints or 1-D
//! integer numpy arrays (any width; contiguous arrays are read as slices, no per-token Python
//! objects); floats, bools, strings and non-1-D shapes raise ValueError.

use numpy::{
    PyArray1, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray1, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyOverflowError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PyString};
use tree_core::CoreError;

pub fn value_error(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

/// BadArgument -> ValueError; not locked, free-group misuse, broken invariant -> RuntimeError.
pub fn core_err(e: CoreError) -> PyErr {
    match e {
        CoreError::BadArgument(m) => PyValueError::new_err(m),
        other => PyRuntimeError::new_err(other.message().to_owned()),
    }
}

/// An optional argument whose default must stay distinguishable from an explicit None.
pub enum Arg<'py> {
    Default,
    Given(Bound<'py, PyAny>),
}

impl<'py> FromPyObject<'py> for Arg<'py> {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        Ok(Arg::Given(ob.clone()))
    }
}

impl Arg<'_> {
    pub fn int_or(&self, default: i64, name: &str) -> PyResult<i64> {
        match self {
            Arg::Default => Ok(default),
            Arg::Given(ob) => as_int(ob, name),
        }
    }
}

fn type_name(ob: &Bound<'_, PyAny>) -> String {
    ob.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".into())
}

/// A Python int (not a bool; anything with `__index__`), else ValueError.
pub fn as_int(ob: &Bound<'_, PyAny>, name: &str) -> PyResult<i64> {
    if ob.is_instance_of::<PyBool>() {
        return Err(value_error(format!("{name} must be an int, got a bool")));
    }
    ob.extract::<i64>().map_err(|e| {
        if e.is_instance_of::<PyOverflowError>(ob.py()) {
            value_error(format!("{name} = {ob} does not fit in 64 bits"))
        } else {
            value_error(format!("{name} must be an int, got {}", type_name(ob)))
        }
    })
}

/// A non-negative int, else ValueError.
pub fn as_size(ob: &Bound<'_, PyAny>, name: &str) -> PyResult<i64> {
    let n = as_int(ob, name)?;
    if n < 0 {
        return Err(value_error(format!("{name} must be >= 0, got {n}")));
    }
    Ok(n)
}

/// `extra_key`: None or "" is no namespace; anything but a str is a ValueError.
pub fn extra_key<'a>(ob: Option<&'a Bound<'_, PyAny>>) -> PyResult<Option<&'a str>> {
    let Some(ob) = ob else { return Ok(None) };
    if ob.is_none() {
        return Ok(None);
    }
    match ob.downcast::<PyString>() {
        Ok(s) => s
            .to_str()
            .map(Some)
            .map_err(|e| value_error(format!("extra_key is not valid UTF-8 ({e})"))),
        Err(_) => Err(value_error(format!(
            "extra_key must be a string or None, got {}",
            type_name(ob)
        ))),
    }
}

/// Integer buffer read from Python: a borrowed contiguous int64 array, or a converted copy.
pub enum Ints<'py> {
    Borrowed(PyReadonlyArray1<'py, i64>),
    Owned(Vec<i64>),
}

impl Ints<'_> {
    pub fn as_slice(&self) -> &[i64] {
        match self {
            Ints::Borrowed(a) => a.as_slice().unwrap_or(&[]),
            Ints::Owned(v) => v,
        }
    }
}

/// A list of ints or a 1-D integer array, else ValueError. A contiguous native int64 array is
/// borrowed, not copied.
pub fn index_ints<'py>(ob: &Bound<'py, PyAny>, name: &str) -> PyResult<Ints<'py>> {
    if let Ok(arr) = ob.downcast::<PyUntypedArray>() {
        return from_array(arr, name);
    }
    if let Ok(list) = ob.downcast::<PyList>() {
        if let Some(v) = from_int_list(list) {
            return Ok(Ints::Owned(v));
        }
    }
    if ob.is_instance_of::<PyString>()
        || ob.is_instance_of::<PyBytes>()
        || !ob.hasattr("__len__")?
    {
        return Err(value_error(format!(
            "{name} must be a list of ints or a 1-D integer array"
        )));
    }
    // Anything else (tuples, ranges, lists of numpy ints or floats...) goes through numpy,
    // exactly like the Python twin.
    let py = ob.py();
    let arr = py
        .import("numpy")?
        .call_method1("asarray", (ob,))
        .map_err(|e| {
            if e.is_instance_of::<PyValueError>(py)
                || e.is_instance_of::<PyOverflowError>(py)
                || e.is_instance_of::<PyTypeError>(py)
            {
                value_error(format!(
                    "{name} must be a list of ints or a 1-D integer array ({e})"
                ))
            } else {
                e
            }
        })?;
    let arr = arr.downcast::<PyUntypedArray>()?;
    if arr.shape().contains(&0) {
        return Ok(Ints::Owned(Vec::new()));
    }
    from_array(arr, name)
}

/// The fast path for a list of plain ints; None when some item needs numpy's rules.
fn from_int_list(list: &Bound<'_, PyList>) -> Option<Vec<i64>> {
    let mut out = Vec::with_capacity(list.len());
    for item in list.iter() {
        if !item.is_exact_instance_of::<PyInt>() {
            return None;
        }
        out.push(item.extract::<i64>().ok()?);
    }
    Some(out)
}

fn shape_str(shape: &[usize]) -> String {
    match shape {
        [n] => format!("({n},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn from_array<'py>(arr: &Bound<'py, PyUntypedArray>, name: &str) -> PyResult<Ints<'py>> {
    if arr.ndim() != 1 {
        return Err(value_error(format!(
            "{name} must be 1-D, got an array of shape {}",
            shape_str(arr.shape())
        )));
    }
    let dtype = arr.dtype();
    if !matches!(dtype.kind(), b'i' | b'u') {
        return Err(value_error(format!(
            "{name} must hold integers, got dtype {dtype}"
        )));
    }
    if let Ok(a) = arr.downcast::<PyArray1<i64>>() {
        let ro = a
            .try_readonly()
            .map_err(|e| value_error(format!("{name}: {e}")))?;
        if ro.as_slice().is_ok() {
            return Ok(Ints::Borrowed(ro));
        }
        return Ok(Ints::Owned(ro.as_array().iter().copied().collect()));
    }
    macro_rules! widen {
        ($($t:ty),*) => {$(
            if let Ok(a) = arr.downcast::<PyArray1<$t>>() {
                let ro = a.try_readonly().map_err(|e| value_error(format!("{name}: {e}")))?;
                let view = ro.as_array();
                let mut out = Vec::with_capacity(view.len());
                for &v in view.iter() {
                    match i64::try_from(v) {
                        Ok(x) => out.push(x),
                        Err(_) => return Err(value_error(format!("{name} has values that do not fit in int64"))),
                    }
                }
                return Ok(Ints::Owned(out));
            }
        )*};
    }
    widen!(i32, u32, u64, i16, u16, i8, u8);
    // A non-native byte order: let numpy convert it.
    let native = arr.call_method1("astype", ("int64",))?;
    match native.downcast::<PyArray1<i64>>() {
        Ok(a) => Ok(Ints::Owned(
            a.try_readonly()
                .map_err(|e| value_error(format!("{name}: {e}")))?
                .as_array()
                .to_vec(),
        )),
        Err(_) => Err(value_error(format!(
            "{name} has an unsupported integer dtype {dtype}"
        ))),
    }
}
