"""DeepSeek-V2 / V2-Lite / V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): latent
attention (sglite.models.decoder_mla) in Llama's pre-norm layers; dense MLPs only, for now.

What the config means (as transformers 5.x runs it):
- attention: `kv_lora_rank`, `q_lora_rank` (None: q_proj, as V2-Lite), `qk_nope_head_dim`,
  `qk_rope_head_dim`, `v_head_dim`; `attention_bias` on q_a_proj, kv_a_proj_with_mqa and
  o_proj. RoPE over the rope dims, their pairs interleaved in the checkpoint (V2 always, V3
  unless `rope_interleave` is false).
- softmax scale: `qk_head_dim ** -0.5`, times `mscale(factor, mscale_all_dim) ** 2` when the
  rope is scaled and `mscale_all_dim` is set, where mscale(s, m) = 0.1 m ln(s) + 1 for s > 1
  (yarn's own attention factor, mscale / mscale_all_dim, multiplies cos and sin as usual).
- MLP of layer i: dense (`intermediate_size`) when i < `first_k_dense_replace`, else
  mixture-of-experts (`mlp_for_layer`). MoE layers are refused by name until they are
  implemented: a config loads when `first_k_dense_replace >= num_hidden_layers`.
- V3 checkpoints carry multi-token-prediction layers after the last one
  (`num_nextn_predict_layers`); decoding does not use them and they are not loaded.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sglite.layers.latent_attention import MLASpec
from sglite.layers.rope_scaling import rope_type_of
from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder import Build, dense_mlp
from sglite.models.decoder_spec import ConfigFields, DecoderSpec


def _mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """transformers' `yarn_apply_mscale` over `qk_head_dim ** -0.5` (see the module doc)."""
    scale = qk_head_dim**-0.5
    if rope_type_of(rope_scaling) != "default" and rope_scaling.get("mscale_all_dim"):
        m = _mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
        scale *= m * m
    return scale


def is_moe_layer(hf, layer_id: int) -> bool:
    """Whether layer `layer_id` of a DeepSeek config is a mixture-of-experts layer."""
    routed = getattr(hf, "n_routed_experts", None)
    first_dense = getattr(hf, "first_k_dense_replace", None) or 0
    return bool(routed) and layer_id >= first_dense


def mla_spec(f: ConfigFields) -> MLASpec:
    return MLASpec(
        kv_lora_rank=int(f.require("kv_lora_rank")),
        q_lora_rank=int(f.hf.q_lora_rank) if f.has("q_lora_rank") else None,
        qk_nope_head_dim=int(f.require("qk_nope_head_dim")),
        qk_rope_head_dim=int(f.require("qk_rope_head_dim")),
        v_head_dim=int(f.require("v_head_dim")),
    )


def deepseek_spec(f: ConfigFields, rope_interleaved: bool) -> DecoderSpec:
    hf, cfg = f.hf, f.config
    moe = [i for i in range(cfg.num_layers) if is_moe_layer(hf, i)]
    if moe:
        f.refuse(
            "first_k_dense_replace",
            getattr(hf, "first_k_dense_replace", None),
            f"layers {moe[0]}..{moe[-1]} of {cfg.num_layers} are mixture-of-experts layers "
            f"(n_routed_experts={hf.n_routed_experts}), which sglite does not run for "
            f"{f.arch} yet; only configs whose layers are all dense load "
            f"(first_k_dense_replace >= num_hidden_layers={cfg.num_layers})",
        )
    f.expect("moe_layer_freq", 1)
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
    )


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        return deepseek_spec(f, rope_interleaved=True)

    def mlp_for_layer(self, b: Build, layer_id: int) -> nn.Module:
        """Dense below `first_k_dense_replace`, mixture-of-experts from there (where the MoE
        layer plugs in; `decoder_spec` refuses such configs until it does)."""
        if is_moe_layer(b.config.hf_config, layer_id):
            raise ValueError(f"layer {layer_id} is a mixture-of-experts layer")
        return dense_mlp(b, layer_id)

    def checkpoint_targets(
        self, name: str, tensor: torch.Tensor
    ) -> list[tuple[str, str | int | None, torch.Tensor]]:
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) >= self.config.num_layers:
            return []  # a multi-token-prediction layer (num_nextn_predict_layers)
        return super().checkpoint_targets(name, tensor)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @classmethod
    def decoder_spec(cls, f: ConfigFields) -> DecoderSpec:
        return deepseek_spec(f, rope_interleaved=bool(f.get("rope_interleave", True)))
