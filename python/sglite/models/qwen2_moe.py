"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (Q/K/V bias, `qkv_bias`) with
sparse layers that add a shared expert gated per token by `sigmoid(shared_expert_gate(x))`.

`shared_expert_intermediate_size: 0`: no shared expert (transformers builds one of width 0,
whose output is zero); its empty tensors and its gate in the checkpoint are dropped."""

from __future__ import annotations

import torch

from sglite.layers.moe import SharedExpertSpec
from sglite.models.decoder_spec import ConfigFields, DecoderSpec
from sglite.models.moe_lm import MoeForCausalLM, qwen_moe_spec


class Qwen2MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        shared = None
        if f.get("shared_expert_intermediate_size", 0):
            size = int(f.require("shared_expert_intermediate_size"))
            shared = SharedExpertSpec(size, gated=True, act=f.act())
        return DecoderSpec(
            norm=f.norm("rms", "rms_norm_eps"),
            act=f.act(),
            qkv_bias=bool(f.get("qkv_bias", True)),
            moe=qwen_moe_spec(f, shared),
        )

    def checkpoint_targets(self, name: str, tensor: torch.Tensor):
        moe = self.spec.moe
        if moe is not None and moe.shared is None:
            if ".shared_expert_gate." in name or (".shared_expert." in name and not tensor.numel()):
                return []  # the width-0 shared expert adds nothing
        return super().checkpoint_targets(name, tensor)
