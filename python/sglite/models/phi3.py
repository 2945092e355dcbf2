"""Phi-3 / Phi-3.5 / Phi-4: Llama's graph over fused `qkv_proj` and `gate_up_proj` checkpoint
tensors (loaded whole, split by the layers), partial rotary where configured, `longrope`
(`su`) scaling with short and long factors (sglite.layers.rotary_embedding)."""

from __future__ import annotations

from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec


class Phi3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        return DecoderSpec(
            norm=f.norm("rms", "rms_norm_eps"), act=f.act(), rotary_factor=f.rotary_factor()
        )
