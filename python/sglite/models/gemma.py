"""Gemma (1): GeGLU (`gelu_pytorch_tanh`), `(1 + w)` RMSNorm, embeddings times sqrt(hidden)
rounded to the model dtype first; otherwise Llama's graph."""

from __future__ import annotations

from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec


class GemmaForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        f.expect("use_bidirectional_attention", False, "sglite's attention is causal")
        return DecoderSpec(
            norm=f.norm("rms_offset", "rms_norm_eps"),
            act=f.act(),
            **f.attention_biases(),
            embed_scale=f.config.hidden_size**0.5,
            embed_scale_in_dtype=True,
        )
