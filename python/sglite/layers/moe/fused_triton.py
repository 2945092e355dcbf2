"""Routed experts on CUDA: `FusedExperts`' forward through the Triton fused-MoE kernels.

The kernels (`sglite_kernels.fused_moe`: align by expert, gate/up grouped GEMM with the
gated activation in its epilogue, down grouped GEMM times the routing weight, sum over the
top-k slots) compute what `fused_cpu.grouped_forward` computes over the same stacked
weights, with no host sync (CUDA graphs can capture it). This module maps an
`ExpertsSpec` and an `ExpertShard` to the kernels' arguments: the activation by its
transformers name, gpt-oss's clamped SwiGLU with its alpha and limit, the biases (the down
bias only on the rank that adds it, see ExpertShard.adds_down_bias), the local expert range.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglite_kernels.fused_moe import fused_moe

if TYPE_CHECKING:
    from sglite.layers.moe.experts import FusedExperts

# transformers' `hidden_act` names (every key of layers.activation.ACTIVATIONS, and gpt-oss's)
# -> the kernels' activations
KERNEL_ACT = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_accurate": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "quick_gelu": "quick_gelu",
    "relu": "relu",
    "relu2": "relu2",
    "clamped_swiglu": "clamped_swiglu",
}


def triton_forward(
    experts: FusedExperts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """`experts`' partial output `[T, H]` for tokens `x [T, H]` routed to `topk_ids`."""
    spec, shard = experts.spec, experts.shard
    if experts.w13_weight is None:
        raise ValueError("the experts' weights were prepacked for CPU; the Triton path needs them")
    b2 = experts.w2_bias if shard.adds_down_bias else None
    return fused_moe(
        x,
        topk_ids,
        topk_weights,
        experts.w13_weight,
        experts.w2_weight,
        b13=experts.w13_bias,
        b2=b2,
        expert_start=shard.expert_start,
        act=KERNEL_ACT[spec.act],
        swiglu_alpha=spec.swiglu_alpha,
        swiglu_limit=spec.swiglu_limit,
    )
