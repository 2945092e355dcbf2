"""Granite: Llama's graph with four multipliers: on the embeddings, on each residual branch,
as the softmax scale (`attention_multiplier`), and logits divided by `logits_scaling`."""

from __future__ import annotations

from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec
from sglite.models.llama import llama_spec


class GraniteForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        return llama_spec(
            f,
            embed_scale=float(f.require("embedding_multiplier")),
            residual_scale=float(f.require("residual_multiplier")),
            attn_scale=float(f.require("attention_multiplier")),
            logit_scale=1.0 / float(f.require("logits_scaling")),
        )
