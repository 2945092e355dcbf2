"""Giving the C heap's free memory back to the OS (glibc only; a no-op elsewhere)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc only; a no-op elsewhere).

    Forwards of varying shapes leave glibc's arenas (one per thread that allocated) holding
    freed memory; trimming when the scheduler goes idle keeps a long-running server's RSS
    at its working set instead of its high-water mark."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
