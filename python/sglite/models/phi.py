"""Phi (1, 1.5, 2): one LayerNorm feeding attention and a plain GELU MLP in parallel, biases
everywhere (the LM head too), partial rotary (0.5), and with `qk_layernorm` a LayerNorm over
each q and k head."""

from __future__ import annotations

from sglite.layers.qk_norm import QKNormSpec
from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec


class PhiForCausalLM(DecoderForCausalLM):
    renames = {
        "dense": "o_proj",
        "fc1": "up_proj",
        "fc2": "down_proj",
        "final_layernorm": "norm",
        "q_layernorm": "q_norm",
        "k_layernorm": "k_norm",
    }

    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        norm = f.norm("layer", "layer_norm_eps")
        qk_norm = None
        if f.get("qk_layernorm", False):
            f.head_dim_is_hidden_over_heads()  # its q/k norms are hidden_size / heads wide
            qk_norm = QKNormSpec("head", norm)
        return DecoderSpec(
            norm=norm,
            act=f.act(),
            layout="parallel",
            gated_mlp=False,
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            qk_norm=qk_norm,
            rotary_factor=f.rotary_factor(),
            lm_head_bias=True,
        )
