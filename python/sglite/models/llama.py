"""The Llama family (Llama 2/3, Mistral, SmolLM2): pre-norm RMSNorm layers, SwiGLU (or any
`hidden_act`), Q/K/V and o_proj biases from `attention_bias`, MLP biases from `mlp_bias`."""

from __future__ import annotations

from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        bias = bool(f.get("attention_bias", False))
        return DecoderSpec(
            norm=f.norm("rms", "rms_norm_eps"),
            act=f.act(),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bool(f.get("mlp_bias", False)),
        )


class MistralForCausalLM(DecoderForCausalLM):
    """Llama's graph without biases (its attention ignores `attention_bias`)."""

    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        return DecoderSpec(norm=f.norm("rms", "rms_norm_eps"), act=f.act())
