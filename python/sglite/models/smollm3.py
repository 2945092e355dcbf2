"""SmolLM3: Llama's graph where the layers `no_rope_layers` marks 0 skip RoPE (NoPE layers)."""

from __future__ import annotations

from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields, DecoderSpec
from sglite.models.llama import llama_spec


class SmolLM3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        return llama_spec(
            f,
            rope_layers=tuple(bool(x) for x in f.require("no_rope_layers"))[: f.config.num_layers],
        )
