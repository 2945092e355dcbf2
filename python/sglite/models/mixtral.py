"""Mixtral: Mistral's attention (optional sliding window on every layer) with every MLP a
sparse block of `num_local_experts` experts named `block_sparse_moe.experts.{e}.w1/w3/w2`
(gate, up, down); the top-k weights are always renormalised."""

from __future__ import annotations

from sglite.models.decoder_spec import ConfigFields, DecoderSpec
from sglite.models.moe_lm import MoeForCausalLM, mixtral_moe_spec


class MixtralForCausalLM(MoeForCausalLM):
    renames = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        return DecoderSpec(norm=f.norm("rms", "rms_norm_eps"), act=f.act(), moe=mixtral_moe_spec(f))
