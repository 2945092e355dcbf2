"""OLMoE: OLMo's attention with an RMSNorm over the whole q and k projections (OLMo 2's
`proj` scope), pre-norm layers, every MLP sparse; the top-k weights are not renormalised
unless `norm_topk_prob`. `clip_qkv` is refused: OLMoE clamps after its q/k norm, the
skeleton (OLMo's order) before."""

from __future__ import annotations

from sglite.layers.qk_norm import QKNormSpec
from sglite.models.decoder_spec import ConfigFields, DecoderSpec
from sglite.models.moe_lm import MoeForCausalLM, olmoe_moe_spec


class OlmoeForCausalLM(MoeForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        norm = f.norm("rms", "rms_norm_eps")
        f.expect("clip_qkv", None, "OLMoE clamps q/k after their norm, which sglite does not")
        return DecoderSpec(
            norm=norm,
            act=f.act(),
            **f.attention_biases(),
            qk_norm=QKNormSpec("proj", norm),
            moe=olmoe_moe_spec(f),
        )
