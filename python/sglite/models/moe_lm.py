"""MoE families over the decoder skeleton: their config fields as a MoESpec, and how their
expert tensors reach the stacked expert weights.

A MoE family is a `MoeForCausalLM` whose DecoderSpec carries `moe=` (sglite.layers.moe);
the readers here turn each config style into that spec:

| reader              | config fields                                                     | families |
|---------------------|-------------------------------------------------------------------|----------|
| `qwen_moe_spec`     | num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob, decoder_sparse_step, mlp_only_layers | Qwen2-MoE, Qwen3-MoE |
| `mixtral_moe_spec`  | num_local_experts, num_experts_per_tok, intermediate_size (each expert's); always renormalised | Mixtral |
| `olmoe_moe_spec`    | num_experts, num_experts_per_tok, intermediate_size, norm_topk_prob | OLMoE |
| `deepseek_moe_spec` | n_routed_experts, num_experts_per_tok, moe_intermediate_size, topk_method (greedy, group_limited_greedy, noaux_tc), scoring_func, n_group, topk_group, norm_topk_prob, routed_scaling_factor, n_shared_experts, first_k_dense_replace, moe_layer_freq | DeepSeek-V2/V3 |

Expert checkpoint tensors (after the family's `renames`, e.g. Mixtral's w1/w3/w2), per
expert `...experts.{e}.{gate,up,down}_proj.{weight,bias}` or fused
`...experts.{gate_up,down}_proj[_bias]`, load through FusedExperts' loaders.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch

from sglite.layers.moe import ExpertsSpec, MoESpec, RouterSpec, SharedExpertSpec, moe_layer_schedule
from sglite.models.causal_lm import DecoderForCausalLM
from sglite.models.decoder_spec import ConfigFields

_PER_EXPERT = re.compile(r"^((?:.*\.)?experts)\.(\d+)\.(gate|up|down)_proj\.(weight|bias)$")
_FUSED = re.compile(r"^((?:.*\.)?experts)\.(gate_up|down)_proj(_bias)?$")
_OURS = {"gate": "w13", "up": "w13", "down": "w2", "gate_up": "w13"}
_EXPERT_PARAM = re.compile(r"^(.*\.experts)\.(w13|w2)_(weight|bias)$")


def expert_target(name: str) -> tuple[str, tuple[int, str] | None] | None:
    """(our parameter, shard id) of a routed-expert checkpoint tensor, None for any other."""
    m = _PER_EXPERT.match(name)
    if m:
        prefix, expert, part, kind = m.groups()
        return f"{prefix}.{_OURS[part]}_{kind}", (int(expert), part)
    m = _FUSED.match(name)
    if m:
        prefix, part, bias = m.groups()
        return f"{prefix}.{_OURS[part]}_{'bias' if bias else 'weight'}", None
    return None


class MoeForCausalLM(DecoderForCausalLM):
    """A decoder whose spec has `moe`; routed-expert tensors map onto the stacked weights."""

    def checkpoint_targets(self, name: str, tensor: torch.Tensor):
        renamed = ".".join(self.renames.get(part, part) for part in name.split("."))
        target = expert_target(renamed)
        if target is not None:
            return [(*target, tensor)]
        return super().checkpoint_targets(name, tensor)

    def _checkpoint_name(self, name: str, shard_id) -> str:
        m = _EXPERT_PARAM.match(name)
        if m and isinstance(shard_id, tuple):
            prefix, _, kind = m.groups()
            expert, part = shard_id
            return super()._checkpoint_name(f"{prefix}.{expert}.{part}_proj.{kind}", None)
        return super()._checkpoint_name(name, shard_id)


def _named(reader: Callable[..., MoESpec | None]) -> Callable[..., MoESpec | None]:
    """A spec reader whose invalid-config errors (the specs' own checks) name the arch."""

    @functools.wraps(reader)
    def read(f: ConfigFields, *args, **kwargs):
        try:
            return reader(f, *args, **kwargs)
        except ValueError as e:
            if str(e).startswith(f"{f.arch}:"):
                raise
            raise ValueError(f"{f.arch}: {e}") from None

    return read


def _experts(f: ConfigFields, num_field: str, size_field: str) -> tuple[int, int, int]:
    """(num_experts, top_k, each expert's intermediate size)."""
    return (
        int(f.require(num_field)),
        int(f.require("num_experts_per_tok")),
        int(f.require(size_field)),
    )


@_named
def qwen_moe_spec(f: ConfigFields, shared: SharedExpertSpec | None = None) -> MoESpec | None:
    """Qwen2-MoE / Qwen3-MoE; None when `num_experts` is 0 (every layer dense)."""
    if not f.get("num_experts", 0):
        return None
    num, top_k, size = _experts(f, "num_experts", "moe_intermediate_size")
    schedule = moe_layer_schedule(
        f.config.num_layers,
        decoder_sparse_step=int(f.get("decoder_sparse_step", 1)),
        mlp_only_layers=f.get("mlp_only_layers", ()),
    )
    return MoESpec(
        RouterSpec(num, top_k, renormalize=bool(f.get("norm_topk_prob", False))),
        ExpertsSpec(num, size, act=f.act()),
        shared=shared,
        sparse_layers=schedule,
    )


@_named
def mixtral_moe_spec(f: ConfigFields) -> MoESpec:
    num, top_k, size = _experts(f, "num_local_experts", "intermediate_size")
    return MoESpec(RouterSpec(num, top_k, renormalize=True), ExpertsSpec(num, size, act=f.act()))


@_named
def olmoe_moe_spec(f: ConfigFields) -> MoESpec:
    num, top_k, size = _experts(f, "num_experts", "intermediate_size")
    renormalize = bool(f.get("norm_topk_prob", False))
    return MoESpec(RouterSpec(num, top_k, renormalize=renormalize), ExpertsSpec(num, size, f.act()))


# topk_method -> (group score, whether the choice adds e_score_correction_bias)
_DEEPSEEK_METHODS = {
    "greedy": (None, False),
    "group_limited_greedy": ("max", False),
    "noaux_tc": ("top2_sum", True),
}


@_named
def deepseek_moe_spec(
    f: ConfigFields, topk_method: str = "greedy", scoring_func: str = "softmax"
) -> MoESpec:
    """DeepSeek-V2 / V2-Lite / V3 (and configs of their shape). `topk_method` and
    `scoring_func` are the defaults for a config without them (transformers' V3 config
    class has neither: pass noaux_tc and sigmoid, what it always runs). The gate runs in
    float32. `norm_topk_prob` divides the k weights by their sum (only with k > 1), then
    every weight is scaled by `routed_scaling_factor`, as V3 does; V2's checkpoints have
    norm_topk_prob false, where V2's order (scale only when not normalised) is the same."""
    num, top_k, size = _experts(f, "n_routed_experts", "moe_intermediate_size")
    method = f.get("topk_method", topk_method)
    if method not in _DEEPSEEK_METHODS:
        f.refuse("topk_method", method, f"sglite implements {', '.join(_DEEPSEEK_METHODS)}")
    group_score, corrected = _DEEPSEEK_METHODS[method]
    scoring = f.get("scoring_func", scoring_func)
    if scoring not in ("softmax", "sigmoid"):
        f.refuse("scoring_func", scoring, "sglite implements softmax and sigmoid")
    groups = {}
    if group_score is not None:
        num_groups, topk_groups = int(f.require("n_group")), int(f.require("topk_group"))
        groups = dict(num_groups=num_groups, topk_groups=topk_groups, group_score=group_score)
    router = RouterSpec(
        num,
        top_k,
        scoring=scoring,
        renormalize=bool(f.get("norm_topk_prob", False)) and top_k > 1,
        correction_bias=corrected,
        scaling_factor=float(f.get("routed_scaling_factor", 1.0)),
        fp32_gate=True,
        **groups,
    )
    num_shared = int(f.get("n_shared_experts", 0))
    shared = SharedExpertSpec(num_shared * size, act=f.act()) if num_shared else None
    schedule = moe_layer_schedule(
        f.config.num_layers,
        first_k_dense_replace=int(f.get("first_k_dense_replace", 0)),
        moe_layer_freq=int(f.get("moe_layer_freq", 1)),
    )
    return MoESpec(router, ExpertsSpec(num, size, act=f.act()), shared, schedule)
