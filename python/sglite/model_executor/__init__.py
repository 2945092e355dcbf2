"""Model execution: ForwardBatch, the ModelRunner and the Sampler.

Heavy imports stay lazy: `from sglite.model_executor import ModelRunner` loads torch then.
"""

from __future__ import annotations

_EXPORTS = {
    "ForwardBatch": "sglite.model_executor.forward_batch",
    "ForwardMode": "sglite.model_executor.forward_batch",
    "ModelRunner": "sglite.model_executor.model_runner",
    "Sampler": "sglite.model_executor.sampler",
    "SamplingBatchInfo": "sglite.model_executor.sampler",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sglite.model_executor' has no attribute {name!r}")
