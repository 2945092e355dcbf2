"""GPT-NeoX (Pythia): LayerNorms with bias, a plain GELU MLP with biases, partial rotary
(`rotary_pct`, 0.25), and with `use_parallel_residual` attention and the MLP side by side,
each behind its own norm. Its fused `query_key_value` holds [q, k, v] per head; it is
reordered to `[q | k | v]` as it loads."""

from __future__ import annotations

import torch

from sglite.layers.layernorm import NormSpec
from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec


class GPTNeoXForCausalLM(DecoderForCausalLM):
    renames = {
        "gpt_neox": "model",
        "embed_in": "embed_tokens",
        "attention": "self_attn",
        "query_key_value": "qkv_proj",
        "dense": "o_proj",
        "dense_h_to_4h": "up_proj",
        "dense_4h_to_h": "down_proj",
        "final_layer_norm": "norm",
        "embed_out": "lm_head",
    }
    # old checkpoints carry the causal mask buffers
    skipped_suffixes = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")

    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        f.head_dim_is_hidden_over_heads()
        f.one_kv_head_per_head()
        bias = bool(f.get("attention_bias", True))
        return DecoderSpec(
            norm=NormSpec("layer", float(f.require("layer_norm_eps"))),
            act=f.act(),
            layout="parallel2" if f.require("use_parallel_residual") else "pre",
            gated_mlp=False,
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=True,
            rotary_factor=f.rotary_factor(),
        )

    def checkpoint_targets(self, name: str, tensor: torch.Tensor):
        if ".query_key_value." in name:  # rows [head][q | k | v][dim] -> [q | k | v][head][dim]
            heads, d = self.config.num_heads, self.config.head_dim
            tensor = tensor.unflatten(0, (heads, 3, d)).transpose(0, 1).flatten(0, 2)
        return super().checkpoint_targets(name, tensor)
