"""Qwen3: Llama's graph with a per-head RMSNorm on q and k before RoPE (q_norm, k_norm)."""

from __future__ import annotations

from sglite.layers.qk_norm import QKNormSpec
from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        norm = f.norm("rms", "rms_norm_eps")
        return DecoderSpec(
            norm=norm, act=f.act(), **f.attention_biases(), qk_norm=QKNormSpec("head", norm)
        )
