"""gpt-oss (gpt-oss-20b, gpt-oss-120b): a pre-norm decoder whose every layer is a MoE.

What differs from Llama, as transformers 5's `GptOssForCausalLM` computes it:
- attention: Q/K/V and o_proj biases (`attention_bias`), a learned sink logit per query head
  (`self_attn.sinks`) in each softmax's denominator, and `layer_types` alternating
  sliding-window (`sliding_window`) and full layers; YaRN RoPE (`rope_parameters`);
- the router (`mlp.router`, ours `mlp.gate`): a linear with a bias, top-k of its logits, then
  the softmax over those k only;
- the experts: gate/up and down with biases, stored fused with gate and up interleaved
  (`gate_up_proj [E, H, 2I]`, even columns gate, odd up; `down_proj [E, I, H]`), and the
  clamped SwiGLU `(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`, `g = clamp(gate, max=l)`
  (`swiglu_alpha`, `swiglu_limit`); `hidden_act` is not read (transformers ignores it too).

Checkpoints: the Hub's ship the experts as MXFP4 (`quantization_config.quant_method ==
"mxfp4"`; `experts.{gate_up,down}_proj_{blocks,scales}`, sglite.models.mxfp4): decoded to
the model dtype as they load. Any other quantization method is refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from sglite.layers.moe import ExpertsSpec, MoESpec, RouterSpec
from sglite.layers.moe.experts import CLAMPED_SWIGLU
from sglite.models.decoder_spec import ConfigFields, DecoderSpec
from sglite.models.moe_lm import MoeForCausalLM
from sglite.models.mxfp4 import Mxfp4Pairs


def _quant_method(f: ConfigFields) -> str | None:
    q: Any = f.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    if method != "mxfp4":
        f.refuse(
            "quantization_config.quant_method",
            method,
            "sglite reads gpt-oss checkpoints in full precision or MXFP4 (decoded at load)",
        )
    return method


class GptOssForCausalLM(MoeForCausalLM):
    renames = {"router": "gate"}

    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        _quant_method(f)
        num, top_k = int(f.require("num_local_experts")), int(f.require("num_experts_per_tok"))
        experts = ExpertsSpec(
            num,
            int(f.require("intermediate_size")),
            act=CLAMPED_SWIGLU,
            swiglu_alpha=float(f.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(f.get("swiglu_limit", 7.0)),
            bias=True,
            fused_form="gpt_oss",
        )
        try:
            moe = MoESpec(RouterSpec(num, top_k, softmax_after_topk=True, bias=True), experts)
        except ValueError as e:
            raise ValueError(f"{f.arch}: {e}") from None
        return DecoderSpec(
            norm=f.norm("rms", "rms_norm_eps"),
            **f.attention_biases(),
            attn_sinks=True,
            moe=moe,
        )

    def checkpoint_targets(self, name: str, tensor: torch.Tensor):
        if Mxfp4Pairs.base_name(name) is not None:
            decoded = self._mxfp4.add(name, tensor)
            if decoded is None:
                return []  # the other half is still to come
            base, weight = decoded  # [E, R, C] -> the fused in-memory layout [E, C, R]
            return super().checkpoint_targets(base, weight.transpose(1, 2))
        return super().checkpoint_targets(name, tensor)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._mxfp4 = Mxfp4Pairs()

        def checked() -> Iterator[tuple[str, torch.Tensor]]:
            yield from weights
            self._mxfp4.check_complete()

        try:
            super().load_weights(checked())
        finally:
            del self._mxfp4
