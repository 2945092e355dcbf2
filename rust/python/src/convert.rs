//! Argument conversion at the Python boundary: ints, index buffers, namespaces, errors.
//!
//! Mirrors `python/sglite/core/_arrays.py`: token ids and slots come as lists of ints or 1-D
//! integer numpy arrays (any width; contiguous arrays are read as slices, no per-token Python
//! objects); floats, bools, strings and non-1-D shapes raise ValueError.

use numpy::{
    PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods,
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
    ob.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "object".into())
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
        Ok(s) => s.to_str().map(Some).map_err(|e| value_error(format!("extra_key is not valid UTF-8 ({e})"))),
        Err(_) => Err(value_error(format!("extra_key must be a string or None, got {}", type_name(ob)))),
    }
}

/// How one integer becomes an element of the output buffer (or why it cannot).
pub trait IndexValue: Copy + numpy::Element {
    fn from_i64(v: i64, name: &str) -> PyResult<Self>;
}

impl IndexValue for i64 {
    #[inline]
    fn from_i64(v: i64, _name: &str) -> PyResult<Self> {
        Ok(v)
    }
}

impl IndexValue for u32 {
    #[inline]
    fn from_i64(v: i64, name: &str) -> PyResult<Self> {
        u32::try_from(v).map_err(|_| value_error(tree_core::out_of_u32(name, v)))
    }
}

/// A list of ints or a 1-D integer array as a Vec<T>, else ValueError.
pub fn index_vec<T: IndexValue>(ob: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<T>> {
    if let Ok(arr) = ob.downcast::<PyUntypedArray>() {
        return from_array(arr, name);
    }
    if let Ok(list) = ob.downcast::<PyList>() {
        if let Some(v) = from_int_list(list, name)? {
            return Ok(v);
        }
    }
    if ob.is_instance_of::<PyString>() || ob.is_instance_of::<PyBytes>() || !ob.hasattr("__len__")? {
        return Err(value_error(format!("{name} must be a list of ints or a 1-D integer array")));
    }
    // Anything else (tuples, ranges, lists of numpy ints or floats...) goes through numpy,
    // exactly like the Python twin.
    let py = ob.py();
    let arr = py.import("numpy")?.call_method1("asarray", (ob,)).map_err(|e| {
        if e.is_instance_of::<PyValueError>(py) || e.is_instance_of::<PyOverflowError>(py) || e.is_instance_of::<PyTypeError>(py) {
            value_error(format!("{name} must be a list of ints or a 1-D integer array ({e})"))
        } else {
            e
        }
    })?;
    let arr = arr.downcast::<PyUntypedArray>()?;
    if arr.len() == 0 || arr.shape().contains(&0) {
        return Ok(Vec::new());
    }
    from_array(arr, name)
}

/// The fast path for a list of plain ints; None when some item needs numpy's rules.
fn from_int_list<T: IndexValue>(list: &Bound<'_, PyList>, name: &str) -> PyResult<Option<Vec<T>>> {
    let mut out = Vec::with_capacity(list.len());
    for item in list.iter() {
        if !item.is_exact_instance_of::<PyInt>() {
            return Ok(None);
        }
        match item.extract::<i64>() {
            Ok(v) => out.push(T::from_i64(v, name)?),
            Err(_) => return Ok(None),
        }
    }
    Ok(Some(out))
}

fn shape_str(shape: &[usize]) -> String {
    match shape {
        [n] => format!("({n},)"),
        _ => format!("({})", shape.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")),
    }
}

fn from_array<T: IndexValue>(arr: &Bound<'_, PyUntypedArray>, name: &str) -> PyResult<Vec<T>> {
    if arr.ndim() != 1 {
        return Err(value_error(format!("{name} must be 1-D, got an array of shape {}", shape_str(arr.shape()))));
    }
    let dtype = arr.dtype();
    if !matches!(dtype.kind(), b'i' | b'u') {
        return Err(value_error(format!("{name} must hold integers, got dtype {dtype}")));
    }
    macro_rules! read_as {
        ($($t:ty),*) => {$(
            if let Ok(a) = arr.downcast::<PyArray1<$t>>() {
                return read_typed::<$t, T>(a, name);
            }
        )*};
    }
    read_as!(i64, i32, u32, u64, i16, u16, i8, u8);
    // A non-native byte order: let numpy convert it.
    let native = arr.call_method1("astype", ("int64",))?;
    match native.downcast::<PyArray1<i64>>() {
        Ok(a) => read_typed::<i64, T>(a, name),
        Err(_) => Err(value_error(format!("{name} has an unsupported integer dtype {dtype}"))),
    }
}

trait AsI64: Copy + numpy::Element {
    fn to_i64(self) -> Option<i64>;
}

macro_rules! as_i64 {
    ($($t:ty),*) => {$(
        impl AsI64 for $t {
            #[inline]
            fn to_i64(self) -> Option<i64> {
                i64::try_from(self).ok()
            }
        }
    )*};
}
as_i64!(i64, i32, u32, u64, i16, u16, i8, u8);

fn read_typed<S: AsI64, T: IndexValue>(arr: &Bound<'_, PyArray1<S>>, name: &str) -> PyResult<Vec<T>> {
    let ro = arr.try_readonly().map_err(|e| value_error(format!("{name}: {e}")))?;
    let convert = |v: S| match v.to_i64() {
        Some(x) => T::from_i64(x, name),
        None => Err(value_error(format!("{name} has values that do not fit in int64"))),
    };
    match ro.as_slice() {
        Ok(slice) => slice.iter().map(|&v| convert(v)).collect(),
        Err(_) => ro.as_array().iter().map(|&v| convert(v)).collect(),
    }
}
