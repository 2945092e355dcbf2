"""Attention backends and their registry: `create_attention_backend(name, runner)`.

| name           | class                                              | where            |
|----------------|----------------------------------------------------|------------------|
| cpu            | sglite.attention.cpu.CpuAttnBackend                  | CPU (default)    |
| torch_native   | sglite.attention.torch_native.TorchNativeAttnBackend | CPU and CUDA     |
| triton         | sglite.attention.triton_backend.TritonAttnBackend    | CUDA (default)   |

`cpu` is torch_native with decode rows computed by the native kernel (rust/attn); where that
kernel cannot run (no native module), the CPU default is torch_native.

Every backend computes the per-layer variations RadixAttention declares (sliding window,
logit soft-cap, attention sinks; `AttentionBackend.features`), and reads only the keys a
window lets a row see. `attend.py` holds the torch math the torch paths share.

Backends are imported only when chosen, so a missing triton does not break the CPU path.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglite.attention.base import AttentionBackend
    from sglite.model_executor.model_runner import ModelRunner

BACKENDS = {
    "cpu": ("sglite.attention.cpu", "CpuAttnBackend"),
    "torch_native": ("sglite.attention.torch_native", "TorchNativeAttnBackend"),
    "triton": ("sglite.attention.triton_backend", "TritonAttnBackend"),
}


def default_backend(device_type: str) -> str:
    if device_type == "cuda":
        return "triton"
    return "cpu" if cpu_kernel_unavailable_reason() is None else "torch_native"


def cpu_kernel_unavailable_reason() -> str | None:
    """None when the native decode-attention kernel can run here, else why not (no torch
    import: the main process calls this to pick the default backend)."""
    try:
        from sglite import _core
    except ImportError as e:
        return f"the native module sglite._core does not import ({e})"
    if not hasattr(_core, "DecodePlan"):
        return "the native module sglite._core is older than this package; reinstall it"
    return None


def create_attention_backend(name: str, runner: ModelRunner) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of: {', '.join(BACKENDS)}"
        )
    module_name, class_name = BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"attention backend {name!r} is unavailable: {e}; use --attention-backend torch_native"
        ) from e
    return getattr(module, class_name)(runner)
