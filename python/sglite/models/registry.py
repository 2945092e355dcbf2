"""Model registry: the HF `architectures` name of a checkpoint -> the sglite model class."""

from __future__ import annotations

import importlib

from torch import nn

# architecture name -> module defining it (imported only when that architecture is loaded)
MODELS = {
    "LlamaForCausalLM": "sglite.models.llama",
    "MistralForCausalLM": "sglite.models.llama",
    "Qwen2ForCausalLM": "sglite.models.qwen2",
    "Qwen3ForCausalLM": "sglite.models.qwen3",
}


def supported_architectures() -> list[str]:
    return sorted(MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    return getattr(importlib.import_module(MODELS[architecture]), architecture)
