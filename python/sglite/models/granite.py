"""Granite: Llama's graph with four multipliers: on the embeddings, on each residual branch,
as the softmax scale (`attention_multiplier`), and logits divided by `logits_scaling`."""

from __future__ import annotations

from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec


class GraniteForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        bias = bool(f.get("attention_bias", False))
        return DecoderSpec(
            norm=f.norm("rms", "rms_norm_eps"),
            act=f.act(),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bool(f.get("mlp_bias", False)),
            embed_scale=float(f.require("embedding_multiplier")),
            residual_scale=float(f.require("residual_multiplier")),
            attn_scale=float(f.require("attention_multiplier")),
            logit_scale=1.0 / float(f.require("logits_scaling")),
        )
