"""Input validation shared by the Python tree core: integer index buffers and sizes."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

EMPTY = np.zeros(0, dtype=np.int64)
MAX_ID = 2**32 - 2  # token ids and slots are stored as u32 by the Rust core


def as_index_array(x: Any, name: str) -> np.ndarray:
    """A 1-D int64 view/copy of `x` (list of ints or integer numpy array), else ValueError."""
    if isinstance(x, np.ndarray):
        arr = x
    else:
        if isinstance(x, (str, bytes)) or not hasattr(x, "__len__"):
            raise ValueError(f"{name} must be a list of ints or a 1-D integer array")
        try:
            arr = np.asarray(x)
        except (ValueError, OverflowError, TypeError) as e:
            raise ValueError(f"{name} must be a list of ints or a 1-D integer array ({e})") from e
        if arr.size == 0:
            arr = EMPTY
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got an array of shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} has values that do not fit in int64")
    return arr.astype(np.int64, copy=False)


def as_size(x: Any, name: str) -> int:
    """A non-negative Python int, else ValueError."""
    if isinstance(x, bool):
        raise ValueError(f"{name} must be an int, got a bool")
    try:
        n = operator.index(x)
    except TypeError as e:
        raise ValueError(f"{name} must be an int, got {type(x).__name__}") from e
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")
    return n


def as_int(x: Any, name: str) -> int:
    """A Python int (any sign), else ValueError."""
    if isinstance(x, bool):
        raise ValueError(f"{name} must be an int, got a bool")
    try:
        return operator.index(x)
    except TypeError as e:
        raise ValueError(f"{name} must be an int, got {type(x).__name__}") from e


def as_namespace(extra_key: str | None) -> str | None:
    """A cache namespace: a non-empty string, or None ("" means None)."""
    if extra_key is None or extra_key == "":
        return None
    if not isinstance(extra_key, str):
        raise ValueError(f"extra_key must be a string or None, got {type(extra_key).__name__}")
    return extra_key
