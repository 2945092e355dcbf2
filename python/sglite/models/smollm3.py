"""SmolLM3: Llama's graph where the layers `no_rope_layers` marks 0 skip RoPE (NoPE layers)."""

from __future__ import annotations

from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec


class SmolLM3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        bias = bool(f.get("attention_bias", False))
        return DecoderSpec(
            norm=f.norm("rms", "rms_norm_eps"),
            act=f.act(),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bool(f.get("mlp_bias", False)),
            rope_layers=tuple(bool(x) for x in f.require("no_rope_layers")),
        )
