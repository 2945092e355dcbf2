"""Starcoder2: LayerNorms with bias, biases on every projection (`use_bias`), and a plain
GELU MLP (`c_fc`, `c_proj`). Its sliding window is the attention backends' (ModelConfig)."""

from __future__ import annotations

from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec


class Starcoder2ForCausalLM(DecoderForCausalLM):
    renames = {"c_fc": "up_proj", "c_proj": "down_proj"}

    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        bias = bool(f.require("use_bias"))
        return DecoderSpec(
            norm=f.norm("layer", "norm_epsilon"),
            act=f.act(),
            gated_mlp=False,
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bias,
        )
