"""The Llama family (Llama 2/3, Mistral, SmolLM2): pre-norm RMSNorm layers, SwiGLU (or any
`hidden_act`), Q/K/V and o_proj biases from `attention_bias`, MLP biases from `mlp_bias`.
`llama_spec` is the start of the families that read those fields as Llama does."""

from __future__ import annotations

from typing import Any

from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec


def llama_spec(f: ConfigFields, **changes: Any) -> DecoderSpec:
    """Llama's spec with `changes` (DecoderSpec fields) on top."""
    return DecoderSpec(
        norm=f.norm("rms", "rms_norm_eps"),
        act=f.act(),
        **f.attention_biases(),
        mlp_bias=bool(f.get("mlp_bias", False)),
        **changes,
    )


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        return llama_spec(f)


class MistralForCausalLM(DecoderForCausalLM):
    """Llama's graph without biases (its attention ignores `attention_bias`)."""

    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        return DecoderSpec(norm=f.norm("rms", "rms_norm_eps"), act=f.act())
