"""GLM-4 (Glm4ForCausalLM): RMSNorms before and after both attention and the MLP (the
`sandwich` layout), a Q/K/V bias (none on o_proj), a fused `gate_up_proj`, and RoPE on part
of each head (`partial_rotary_factor`, 0.5) in the interleaved layout."""

from __future__ import annotations

from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec


class Glm4ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        return DecoderSpec(
            norm=f.norm("rms", "rms_norm_eps"),
            act=f.act(),
            layout="sandwich",
            qkv_bias=bool(f.get("attention_bias", False)),
            rotary_factor=f.rotary_factor(),
            rope_interleaved=True,
        )
