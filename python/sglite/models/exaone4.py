"""EXAONE 4: OLMo 2's post layout (sglite.models.olmo) with a per-head q/k RMSNorm."""

from __future__ import annotations

from sglite.layers.qk_norm import QKNormSpec
from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec
from sglite.models.olmo import POST_NORMS


class Exaone4ForCausalLM(DecoderForCausalLM):
    """EXAONE 4: OLMo 2's post layout with per-head q/k RMSNorm. With a sliding window, only
    the windowed layers rotate (the global ones are NoPE); without one, every layer does."""

    renames = POST_NORMS

    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        norm = f.norm("rms", "rms_norm_eps")
        rope_layers = None
        if f.get("sliding_window") is not None:
            types = f.require("layer_types")
            rope_layers = tuple(t == "sliding_attention" for t in types)
        return DecoderSpec(
            norm=norm,
            act=f.act(),
            layout="post",
            qk_norm=QKNormSpec("head", norm),
            rope_layers=rope_layers,
        )
