"""Gemma (1, 2, 3 text): GeGLU (`gelu_pytorch_tanh`), `(1 + w)` RMSNorm, embeddings times
sqrt(hidden) rounded to the model dtype first; otherwise Llama's graph.

Gemma 2 adds norms after attention and after the MLP (the `sandwich` layout), the softmax
scale `query_pre_attn_scalar ** -0.5`, attention scores soft-capped at
`attn_logit_softcapping` and logits at `final_logit_softcapping`, and sliding-window layers
between global ones (`layer_types`, read by ModelConfig). Gemma 3 (text) is Gemma 2 with a
per-head `(1 + w)` RMSNorm on q and k, a local RoPE base on its sliding layers and
`rope_scaling` on its global ones only (ModelConfig.rope_by_layer_type: two rotary tables),
and no attention soft-cap.
"""

from __future__ import annotations

from typing import Any

from sglite.layers.qk_norm import QKNormSpec
from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec

# checkpoint -> ours: Gemma 2/3 name the attention's output norm post_attention_layernorm and
# the MLP's input norm pre_feedforward_layernorm (sglite.models.decoder's names)
SANDWICH_NORMS = {
    "post_attention_layernorm": "post_self_attn_layernorm",
    "pre_feedforward_layernorm": "post_attention_layernorm",
    "post_feedforward_layernorm": "post_mlp_layernorm",
}


def _embed_scale(f: ConfigFields) -> dict[str, Any]:
    return dict(embed_scale=f.config.hidden_size**0.5, embed_scale_in_dtype=True)


class GemmaForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        f.expect("use_bidirectional_attention", False, "sglite's attention is causal")
        return DecoderSpec(
            norm=f.norm("rms_offset", "rms_norm_eps"),
            act=f.act(),
            **f.attention_biases(),
            **_embed_scale(f),
        )


def gemma2_spec(f: ConfigFields, **changes: Any) -> DecoderSpec:
    """Gemma 2's spec with `changes` (DecoderSpec fields) on top."""
    final_cap = f.get("final_logit_softcapping")
    return DecoderSpec(
        norm=f.norm("rms_offset", "rms_norm_eps"),
        act=f.act("hidden_activation"),
        layout="sandwich",
        **f.attention_biases(),
        attn_scale=float(f.require("query_pre_attn_scalar")) ** -0.5,
        attn_logit_cap=float(f.get("attn_logit_softcapping", 0.0)),
        final_logit_softcap=None if final_cap is None else float(final_cap),
        **_embed_scale(f),
        **changes,
    )


class Gemma2ForCausalLM(DecoderForCausalLM):
    renames = SANDWICH_NORMS

    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        return gemma2_spec(f)


class Gemma3ForCausalLM(DecoderForCausalLM):
    renames = SANDWICH_NORMS

    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        # transformers' Gemma 3 reads the field but never applies it: ambiguous, so refused
        f.expect(
            "attn_logit_softcapping",
            None,
            "Gemma 3 attends without a soft-cap (transformers' Gemma 3 ignores the field)",
        )
        qk_norm = QKNormSpec("head", f.norm("rms_offset", "rms_norm_eps"))
        return gemma2_spec(f, qk_norm=qk_norm)
