"""OLMo (1): Llama's graph with non-parametric LayerNorms (eps 1e-5, no weight or bias) and
q, k, v clamped to +-`clip_qkv` when set. OLMo 2: RMSNorm after attention and after the MLP
instead of before (the `post` layout), and an RMSNorm over the whole q and k projections."""

from __future__ import annotations

from sglite.layers.layernorm import NormSpec
from sglite.layers.qk_norm import QKNormSpec
from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec

# checkpoint -> ours: OLMo 2's norms are its branches' output norms
POST_NORMS = {
    "post_attention_layernorm": "post_self_attn_layernorm",
    "post_feedforward_layernorm": "post_mlp_layernorm",
}


class OlmoForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        clip = f.get("clip_qkv")
        return DecoderSpec(
            norm=NormSpec("layer_noparam", 1e-5),
            act=f.act(),
            **f.attention_biases(),
            clip_qkv=None if clip is None else float(clip),
        )


class Olmo2ForCausalLM(DecoderForCausalLM):
    renames = POST_NORMS

    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        norm = f.norm("rms", "rms_norm_eps")
        return DecoderSpec(
            norm=norm,
            act=f.act(),
            layout="post",
            **f.attention_biases(),
            qk_norm=QKNormSpec("proj", norm),
        )
