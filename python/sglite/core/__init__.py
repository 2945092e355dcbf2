"""The tree-core registry: picks the Rust or the Python implementation of the CPU-side core.

The core is three data structures: `RadixTree` (the prefix-cache index), `PageAllocator`
(which KV pages are free) and `PrefillBudget` (the admission arithmetic). Both backends
expose the same classes, methods, semantics and exceptions; callers never ask which one
they have.

`SGL_TREE_CORE` (read once, through sglite.env) selects:

- `python` (default): the pure-Python twin in this package;
- `rust`: the native `sglite._core`; if it is unusable, a WARNING gives the reason and the
  Python twin is used;
- `auto`: Rust when usable, otherwise Python with an INFO log of the reason.

"Usable" is decided by one compatibility check: the module imports, its version equals the
package version, and it supports the requested configuration (page size, eviction policy).
"""

from __future__ import annotations

import importlib
import logging
import threading
from types import ModuleType, SimpleNamespace
from typing import Any

from sglite import env
from sglite.version import __version__

logger = logging.getLogger(__name__)

CHOICES = env.TREE_CORE_CHOICES
EVICTION_POLICIES = ("lru", "lfu", "fifo", "priority")
_EXPORTS = ("RadixTree", "PageAllocator", "PrefillBudget", "AddReqResult", "CLIP_MAX_NEW_TOKENS")

_lock = threading.Lock()
_cache: dict[tuple, tuple[SimpleNamespace, dict[str, Any]]] = {}
_last: dict[str, Any] | None = None


def _python_backend() -> SimpleNamespace:
    from sglite.core import budget, page_allocator, radix_tree

    return SimpleNamespace(
        name="python",
        RadixTree=radix_tree.RadixTree,
        PageAllocator=page_allocator.PageAllocator,
        PrefillBudget=budget.PrefillBudget,
        AddReqResult=budget.AddReqResult,
        CLIP_MAX_NEW_TOKENS=budget.CLIP_MAX_NEW_TOKENS,
        __version__=__version__,
    )


def _import_native() -> ModuleType:
    return importlib.import_module("sglite._core")


def _check_native(page_size: int | None, eviction_policy: str | None) -> tuple[Any, str | None]:
    """Return (module, None) when the native core is usable, else (None, reason)."""
    try:
        mod = _import_native()
    except ImportError as e:  # not built, wrong platform, missing symbol...
        return None, f"the native module sglite._core could not be imported ({e})"
    version = getattr(mod, "__version__", None)
    if version != __version__:
        return None, (
            f"the native module sglite._core has version {version!r} but the package is "
            f"{__version__!r}; rebuild it (pip install .)"
        )
    missing = [n for n in _EXPORTS if not hasattr(mod, n)]
    if missing:
        return None, f"the native module sglite._core lacks {', '.join(missing)}"
    supported = tuple(getattr(mod, "SUPPORTED_EVICTION_POLICIES", ()))
    if eviction_policy is not None and eviction_policy not in supported:
        return None, (
            f"the native module sglite._core does not support eviction policy "
            f"{eviction_policy!r} (it supports {', '.join(supported)})"
        )
    max_page = int(getattr(mod, "MAX_PAGE_SIZE", 0))
    if page_size is not None and not 1 <= page_size <= max_page:
        return None, (
            f"the native module sglite._core does not support page size {page_size} "
            f"(it supports 1..{max_page})"
        )
    return mod, None


def _native_backend(mod: Any) -> SimpleNamespace:
    ns = {n: getattr(mod, n) for n in _EXPORTS}
    return SimpleNamespace(name="rust", __version__=mod.__version__, **ns)


def resolve(name: str | None) -> str:
    """Normalize a backend request; None reads SGL_TREE_CORE. Unknown values raise ValueError."""
    requested = env.tree_core() if name is None else name.strip().lower()
    if requested not in CHOICES:
        raise ValueError(
            f"unknown tree core {requested!r} (from SGL_TREE_CORE or --tree-core); "
            f"choose one of: {', '.join(CHOICES)}"
        )
    return requested


def load(
    name: str | None = None,
    *,
    page_size: int | None = None,
    eviction_policy: str | None = None,
) -> SimpleNamespace:
    """Return the backend namespace (RadixTree, PageAllocator, PrefillBudget, AddReqResult).

    `name` is python|rust|auto; None reads SGL_TREE_CORE. `page_size` and `eviction_policy`,
    when given, are part of the compatibility check. The check runs once per request shape.
    """
    global _last
    requested = resolve(name)
    if eviction_policy is not None and eviction_policy not in EVICTION_POLICIES:
        raise ValueError(
            f"unknown eviction policy {eviction_policy!r}; choose one of: "
            f"{', '.join(EVICTION_POLICIES)}"
        )
    key = (requested, page_size, eviction_policy)
    with _lock:
        if key not in _cache:
            _cache[key] = _select(requested, page_size, eviction_policy)
        backend, info = _cache[key]
        _last = info
    return backend


def _select(
    requested: str, page_size: int | None, eviction_policy: str | None
) -> tuple[SimpleNamespace, dict[str, Any]]:
    info: dict[str, Any] = {"requested": requested, "reason": None, "version": __version__}
    if requested == "python":
        info["backend"] = "python"
        return _python_backend(), info
    mod, reason = _check_native(page_size, eviction_policy)
    if mod is not None:
        info["backend"] = "rust"
        logger.info("tree core: rust (sglite._core %s)", mod.__version__)
        return _native_backend(mod), info
    info["backend"] = "python"
    info["reason"] = reason
    if requested == "rust":
        logger.warning("SGL_TREE_CORE=rust but %s; using the Python tree core", reason)
    else:
        logger.info("tree core auto: %s; using the Python tree core", reason)
    return _python_backend(), info


def describe() -> dict[str, Any]:
    """The active backend: {backend, requested, reason, version}.

    Describes the most recent `load()`; before any load it resolves SGL_TREE_CORE now.
    """
    if _last is None:
        load()
    assert _last is not None
    return dict(_last)


def _reset_for_tests() -> None:
    """Forget cached decisions so a test can re-run the compatibility check."""
    global _last
    with _lock:
        _cache.clear()
        _last = None
