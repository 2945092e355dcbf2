"""Qwen2 / Qwen2.5: Llama's graph with a bias on the Q, K and V projections (none on o_proj)."""

from __future__ import annotations

from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        return DecoderSpec(norm=f.norm("rms", "rms_norm_eps"), act=f.act(), qkv_bias=True)
