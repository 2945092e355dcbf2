"""Qwen2 / Qwen2.5: Llama's graph with a bias on the Q, K and V projections (none on o_proj)."""

from __future__ import annotations

from sglite.models.llama import LlamaForCausalLM
from sglite.models.model_config import ModelConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def has_qkv_bias(config: ModelConfig) -> bool:
        return True

    @staticmethod
    def has_o_bias(config: ModelConfig) -> bool:
        return False
