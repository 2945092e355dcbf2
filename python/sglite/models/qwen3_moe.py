"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (per-head q/k RMSNorm) with
routed experts only; `norm_topk_prob` renormalises the top-k weights."""

from __future__ import annotations

from sglite.layers.qk_norm import QKNormSpec
from sglite.models.decoder_spec import ConfigFields, DecoderSpec
from sglite.models.moe_lm import MoeForCausalLM, qwen_moe_spec


class Qwen3MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        norm = f.norm("rms", "rms_norm_eps")
        return DecoderSpec(
            norm=norm,
            act=f.act(),
            **f.attention_biases(),
            qk_norm=QKNormSpec("head", norm),
            moe=qwen_moe_spec(f),
        )
