"""Model registry: the HF `architectures` name of a checkpoint -> the sglite model class.

Every class is a DecoderSpec over the shared skeleton (sglite.models.causal_lm), a MoE
family's with a MoESpec (sglite.models.moe_lm); the README's
model table lists them with what was tested.
"""

from __future__ import annotations

import importlib

from torch import nn

# architecture name -> module defining it (imported only when that architecture is loaded)
MODELS = {
    "LlamaForCausalLM": "sglite.models.llama",
    "MistralForCausalLM": "sglite.models.llama",
    "Qwen2ForCausalLM": "sglite.models.qwen2",
    "Qwen3ForCausalLM": "sglite.models.qwen3",
    "GemmaForCausalLM": "sglite.models.gemma",
    "Gemma2ForCausalLM": "sglite.models.gemma",
    "Gemma3ForCausalLM": "sglite.models.gemma",
    "Phi3ForCausalLM": "sglite.models.phi3",
    "PhiForCausalLM": "sglite.models.phi",
    "GraniteForCausalLM": "sglite.models.granite",
    "OlmoForCausalLM": "sglite.models.olmo",
    "Olmo2ForCausalLM": "sglite.models.olmo",
    "Exaone4ForCausalLM": "sglite.models.exaone4",
    "SmolLM3ForCausalLM": "sglite.models.smollm3",
    "Glm4ForCausalLM": "sglite.models.glm4",
    "CohereForCausalLM": "sglite.models.cohere",
    "Cohere2ForCausalLM": "sglite.models.cohere",
    "GPTNeoXForCausalLM": "sglite.models.gpt_neox",
    "StableLmForCausalLM": "sglite.models.stablelm",
    "Starcoder2ForCausalLM": "sglite.models.starcoder2",
    "DeepseekV2ForCausalLM": "sglite.models.deepseek_v2",
    "DeepseekV3ForCausalLM": "sglite.models.deepseek_v2",
    # mixture-of-experts (sglite.models.moe_lm)
    "Qwen2MoeForCausalLM": "sglite.models.qwen2_moe",
    "Qwen3MoeForCausalLM": "sglite.models.qwen3_moe",
    "MixtralForCausalLM": "sglite.models.mixtral",
    "OlmoeForCausalLM": "sglite.models.olmoe",
    "GptOssForCausalLM": "sglite.models.gpt_oss",
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
