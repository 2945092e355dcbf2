"""Cohere (Command R): one LayerNorm without bias feeding attention and the MLP in parallel,
interleaved RoPE, logits times `logit_scale`, and with `use_qk_norm` a LayerNorm over each
q and k head with a weight per head. Cohere 2 (Command R7B, Command A): the same block
without the q/k norm, over sliding-window layers that rotate and full-attention layers that
do not (NoPE)."""

from __future__ import annotations

from sglite.layers.qk_norm import QKNormSpec
from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec


def _cohere_spec(f: ConfigFields, **changes) -> DecoderSpec:
    return DecoderSpec(
        norm=f.norm("layer_nobias", "layer_norm_eps"),
        act=f.act(),
        layout="parallel",
        **f.attention_biases(),
        rope_interleaved=True,
        logit_scale=float(f.require("logit_scale")),
        **changes,
    )


class CohereForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        norm = f.norm("layer_nobias", "layer_norm_eps")
        qk_norm = QKNormSpec("head_weights", norm) if f.get("use_qk_norm", False) else None
        return _cohere_spec(f, qk_norm=qk_norm)


class Cohere2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        # transformers rotates exactly the layers that have a window: with no
        # `sliding_window` at all, none of them
        cfg = f.config
        windowed = tuple(cfg.sliding_window_for(i) is not None for i in range(cfg.num_layers))
        return _cohere_spec(f, rope_layers=windowed)
