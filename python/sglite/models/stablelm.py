"""StableLM (2): LayerNorms with bias, partial rotary (0.25), a Q/K/V bias with
`use_qkv_bias`, attention and the MLP in parallel behind one norm with
`use_parallel_residual`, and with `qk_layernorm` a LayerNorm (no bias) per q and k head,
stored one head per tensor (`norms.<head>.weight`)."""

from __future__ import annotations

import re

import torch

from sglite.layers.layernorm import NormSpec
from sglite.layers.qk_norm import QKNormSpec
from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec

_HEAD_ROW = re.compile(r"\.norms\.(\d+)\.")


class StableLmForCausalLM(DecoderForCausalLM):
    renames = {"q_layernorm": "q_norm", "k_layernorm": "k_norm"}

    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        f.head_dim_is_hidden_over_heads()
        eps = float(f.require("layer_norm_eps"))
        qk_norm = None
        if f.get("qk_layernorm", False):
            qk_norm = QKNormSpec("head_weights", NormSpec("layer_nobias", eps))
        return DecoderSpec(
            norm=NormSpec("layer", eps),
            act=f.act(),
            layout="parallel" if f.require("use_parallel_residual") else "pre",
            qkv_bias=bool(f.get("use_qkv_bias", False)),
            qk_norm=qk_norm,
            rotary_factor=f.rotary_factor(),
        )

    def checkpoint_targets(self, name: str, tensor: torch.Tensor):
        row = _HEAD_ROW.search(name)
        if row is None:
            return super().checkpoint_targets(name, tensor)
        (target, _, _), *_ = super().checkpoint_targets(_HEAD_ROW.sub(".", name), tensor)
        return [(target, int(row.group(1)), tensor)]
