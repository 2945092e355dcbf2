"""Attention backends and their registry: `create_attention_backend(name, runner)`.

| name           | class                                              | where            |
|----------------|----------------------------------------------------|------------------|
| torch_native   | sglite.attention.torch_native.TorchNativeAttnBackend | CPU and CUDA     |
| triton         | sglite.attention.triton_backend.TritonAttnBackend    | CUDA (default)   |

Backends are imported only when chosen, so a missing triton does not break the CPU path.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglite.attention.base import AttentionBackend
    from sglite.model_executor.model_runner import ModelRunner

BACKENDS = {
    "torch_native": ("sglite.attention.torch_native", "TorchNativeAttnBackend"),
    "triton": ("sglite.attention.triton_backend", "TritonAttnBackend"),
}


def default_backend(device_type: str) -> str:
    return "triton" if device_type == "cuda" else "torch_native"


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
