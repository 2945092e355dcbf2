"""Cohere (Command R): one LayerNorm without bias feeding attention and the MLP in parallel,
interleaved RoPE, logits times `logit_scale`, and with `use_qk_norm` a LayerNorm over each
q and k head with a weight per head."""

from __future__ import annotations

from sglite.layers.qk_norm import QKNormSpec
from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec


class CohereForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        norm = f.norm("layer_nobias", "layer_norm_eps")
        qk_norm = QKNormSpec("head_weights", norm) if f.get("use_qk_norm", False) else None
        return DecoderSpec(
            norm=norm,
            act=f.act(),
            layout="parallel",
            **f.attention_biases(),
            qk_norm=qk_norm,
            rope_interleaved=True,
            logit_scale=float(f.require("logit_scale")),
        )
