"""DeepSeek-V2 / V2-Lite / V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): latent
attention (sglite.models.decoder_mla) in Llama's pre-norm layers, dense MLPs below
`first_k_dense_replace` and mixture-of-experts layers from there (sglite.layers.moe).

What the config means (as transformers 5.x runs it):
- attention: `kv_lora_rank`, `q_lora_rank` (None: q_proj, as V2-Lite), `qk_nope_head_dim`,
  `qk_rope_head_dim`, `v_head_dim`; `attention_bias` on q_a_proj, kv_a_proj_with_mqa and
  o_proj. RoPE over the rope dims, their pairs interleaved in the checkpoint (V2 always, V3
  unless `rope_interleave` is false).
- softmax scale: `qk_head_dim ** -0.5`, times `mscale(factor, mscale_all_dim) ** 2` when the
  rope is scaled and `mscale_all_dim` is set, where mscale(s, m) = 0.1 m ln(s) + 1 for s > 1
  (yarn's own attention factor, mscale / mscale_all_dim, multiplies cos and sin as usual).
- MLP of layer i: dense (`intermediate_size`) when i < `first_k_dense_replace`, else (every
  `moe_layer_freq`-th, as DeepSeek's code counts; transformers has only 1) a MoE block
  (`moe_lm.deepseek_moe_spec`): `n_routed_experts` of width `moe_intermediate_size`, top
  `num_experts_per_tok`, weights times `routed_scaling_factor`, and `n_shared_experts`
  shared experts as one ungated MLP. The gate runs in float32.
- routing, V2: softmax scores; `topk_method` greedy or group_limited_greedy (only the
  `topk_group` of `n_group` groups with the best single expert score may be chosen);
  `norm_topk_prob` true is refused (transformers ignores it, DeepSeek's code renormalises
  and then skips the scaling factor: no checkpoint has it). V3 (`noaux_tc`): sigmoid
  scores, `e_score_correction_bias` added for choosing only, groups ranked by the sum of
  their best two corrected scores, `norm_topk_prob` renormalises before the scaling. Any
  other `topk_method` / `scoring_func` is refused by name.
- checkpoint names: `mlp.gate.weight`, `mlp.gate.e_score_correction_bias` (V3),
  `mlp.experts.{e}.{gate,up,down}_proj.weight` (or transformers' fused in-memory tensors),
  `mlp.shared_experts.{gate,up,down}_proj.weight` (ours `mlp.shared_expert`).
- V3 checkpoints carry multi-token-prediction layers after the last one
  (`num_nextn_predict_layers`); decoding does not use them and they are not loaded.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from sglite.layers.latent_attention import MLASpec
from sglite.layers.moe import MoESpec
from sglite.layers.rope_scaling import rope_type_of
from sglite.models.decoder_spec import ConfigFields, DecoderSpec
from sglite.models.moe_lm import MoeForCausalLM, deepseek_moe_spec

# per version: (the topk_method and scoring_func transformers runs, the norm_topk_prob it takes)
_ROUTING = {
    2: (("greedy", "group_limited_greedy"), "softmax", False),
    3: (("noaux_tc",), "sigmoid", True),
}


def _mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """transformers' `yarn_apply_mscale` over `qk_head_dim ** -0.5` (see the module doc)."""
    scale = qk_head_dim**-0.5
    if rope_type_of(rope_scaling) != "default" and rope_scaling.get("mscale_all_dim"):
        m = _mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
        scale *= m * m
    return scale


def mla_spec(f: ConfigFields) -> MLASpec:
    return MLASpec(
        kv_lora_rank=int(f.require("kv_lora_rank")),
        q_lora_rank=int(f.hf.q_lora_rank) if f.has("q_lora_rank") else None,
        qk_nope_head_dim=int(f.require("qk_nope_head_dim")),
        qk_rope_head_dim=int(f.require("qk_rope_head_dim")),
        v_head_dim=int(f.require("v_head_dim")),
    )


def moe_spec(f: ConfigFields, version: int) -> MoESpec | None:
    """The MoE layers' spec, None when every layer is dense; routing options the version
    does not run are refused by name (see the module doc)."""
    num_layers = f.config.num_layers
    if int(f.get("first_k_dense_replace", 0)) >= num_layers or not f.get("n_routed_experts"):
        return None
    methods, scoring, takes_norm = _ROUTING[version]
    method = f.get("topk_method", methods[0])
    if method not in methods:
        f.refuse("topk_method", method, f"DeepSeek-V{version} routes by {' or '.join(methods)}")
    if f.get("scoring_func", scoring) != scoring:
        f.refuse("scoring_func", f.get("scoring_func"), f"DeepSeek-V{version} scores by {scoring}")
    if not takes_norm and f.get("norm_topk_prob", False):
        f.refuse(
            "norm_topk_prob", True,
            f"DeepSeek-V{version}'s transformers code ignores it and DeepSeek's renormalises "
            "without routed_scaling_factor; sglite runs neither guess",
        )  # fmt: skip
    return deepseek_moe_spec(f, topk_method=method, scoring_func=scoring)


def deepseek_spec(f: ConfigFields, rope_interleaved: bool, version: int) -> DecoderSpec:
    cfg = f.config
    if cfg.num_kv_heads != cfg.num_heads:
        f.refuse(
            "num_key_value_heads", cfg.num_kv_heads,
            f"{f.arch}'s latent attention has one key and value per query head "
            f"({cfg.num_heads})",
        )  # fmt: skip
    mla = mla_spec(f)
    bias = bool(f.get("attention_bias", False))
    return DecoderSpec(
        norm=f.norm("rms", "rms_norm_eps"),
        act=f.act(),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(f.get("mlp_bias", False)),
        rope_interleaved=rope_interleaved,
        attn_scale=softmax_scale(mla.qk_head_dim, cfg.rope_scaling),
        mla=mla,
        moe=moe_spec(f, version),
    )


class DeepseekV2ForCausalLM(MoeForCausalLM):
    renames: ClassVar[dict[str, str]] = {"shared_experts": "shared_expert"}

    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        return deepseek_spec(f, rope_interleaved=True, version=2)

    def checkpoint_targets(
        self, name: str, tensor: torch.Tensor
    ) -> list[tuple[str, str | int | None, torch.Tensor]]:
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) >= self.config.num_layers:
            return []  # a multi-token-prediction layer (num_nextn_predict_layers)
        moe = self.spec.moe
        if ".shared_experts." in name and not tensor.numel() and (moe is None or not moe.shared):
            return []  # n_shared_experts 0: transformers' width-0 MLP adds nothing
        return super().checkpoint_targets(name, tensor)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        interleaved = bool(f.get("rope_interleave", True))
        return deepseek_spec(f, rope_interleaved=interleaved, version=3)
