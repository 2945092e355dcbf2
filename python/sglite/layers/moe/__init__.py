"""Mixture-of-experts layers: router, stacked routed experts, shared experts, the block.

- `router`: which k experts each token goes to, and with what weight (`RouterSpec`).
- `experts`: the routed experts' stacked weights, their checkpoint forms and their
  tensor/expert-parallel split (`ExpertsSpec`, `ExpertShard`).
- `fused_cpu`: the grouped expert compute (tokens sorted by expert) and its references.
- `block`: `MoESpec` (what a family declares), the layer schedule and `SparseMoeBlock`.
"""

from sglite.layers.moe.block import (
    MoESpec,
    SharedExpertSpec,
    SparseMoeBlock,
    moe_layer_schedule,
)
from sglite.layers.moe.experts import ExpertShard, ExpertsSpec, FusedExperts, expert_shard
from sglite.layers.moe.router import RouterSpec, TopKRouter, select_experts

__all__ = [
    "ExpertShard",
    "ExpertsSpec",
    "FusedExperts",
    "MoESpec",
    "RouterSpec",
    "SharedExpertSpec",
    "SparseMoeBlock",
    "TopKRouter",
    "expert_shard",
    "moe_layer_schedule",
    "select_experts",
]
