"""The sparse MoE block: router, routed experts, optional shared expert, one all-reduce.

`MoESpec` is what a MoE family declares (the way DecoderSpec declares a dense family): its
router (sglite.layers.moe.router), its experts (sglite.layers.moe.experts), its shared
expert if any, and which layers are sparse (`moe_layer_schedule`); the decoder skeleton
builds a `SparseMoeBlock` for those layers and its dense MLP for the others.

Shared experts: Qwen2-MoE's is gated per token (`sigmoid(x @ shared_expert_gate^T)`), with
its own width `shared_expert_intermediate_size`; DeepSeek's `n_shared_experts` are one
ungated MLP `n_shared_experts * moe_intermediate_size` wide. Under tensor parallelism the
shared expert is split like a dense MLP, but its down projection does not all-reduce: its
partial output joins the experts' and the block reduces the sum once.

Checkpoint names (ours): `mlp.gate.{weight, bias, e_score_correction_bias}`,
`mlp.experts.{w13_weight, w2_weight, w13_bias, w2_bias}`,
`mlp.shared_expert.{gate_up_proj, down_proj}`, `mlp.shared_expert_gate.weight`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from sglite.distributed import NULL_TP_GROUP, TPGroup
from sglite.layers.activation import GatedActivation
from sglite.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglite.layers.moe.experts import ExpertsSpec, FusedExperts
from sglite.layers.moe.router import RouterSpec, TopKRouter


def moe_layer_schedule(
    num_layers: int,
    *,
    first_k_dense_replace: int = 0,
    moe_layer_freq: int = 1,
    decoder_sparse_step: int = 1,
    mlp_only_layers: Iterable[int] = (),
) -> tuple[bool, ...]:
    """Per layer, whether it is sparse. DeepSeek: layers from `first_k_dense_replace` on,
    every `moe_layer_freq`-th (`i % freq == 0`); Qwen-MoE: every `decoder_sparse_step`-th
    counting from 1 (`(i + 1) % step == 0`), except `mlp_only_layers`."""
    if moe_layer_freq < 1 or decoder_sparse_step < 1:
        raise ValueError(
            f"moe_layer_freq={moe_layer_freq} and decoder_sparse_step={decoder_sparse_step} "
            "must be >= 1"
        )
    dense = set(mlp_only_layers)
    return tuple(
        i >= first_k_dense_replace
        and i % moe_layer_freq == 0
        and (i + 1) % decoder_sparse_step == 0
        and i not in dense
        for i in range(num_layers)
    )


@dataclass(frozen=True)
class SharedExpertSpec:
    intermediate_size: int
    gated: bool = False  # Qwen2-MoE: times sigmoid(shared_expert_gate(x)), per token
    act: str = "silu"


@dataclass(frozen=True)
class MoESpec:
    router: RouterSpec
    experts: ExpertsSpec
    shared: SharedExpertSpec | None = None
    sparse_layers: tuple[bool, ...] = ()  # per layer; empty: every layer is sparse

    def __post_init__(self) -> None:
        if self.router.num_experts != self.experts.num_experts:
            raise ValueError(
                f"the router has {self.router.num_experts} experts, the experts "
                f"{self.experts.num_experts}"
            )

    def is_sparse(self, layer_id: int) -> bool:
        return not self.sparse_layers or self.sparse_layers[layer_id]


class PartialRowLinear(RowParallelLinear):
    """A row-parallel linear that leaves the all-reduce to its caller (no bias)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return LinearBase.forward(self, x)


class SharedExpert(nn.Module):
    """A gated MLP whose output is this rank's partial sum."""

    def __init__(
        self, spec: SharedExpertSpec, hidden_size: int, *, dtype, device, tp_group
    ) -> None:
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device, tp_group=tp_group)
        size = spec.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [size, size], **kw)
        self.down_proj = PartialRowLinear(size, hidden_size, **kw)
        self.act_fn = GatedActivation(spec.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        spec: MoESpec,
        hidden_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | None = None,
        tp_group: TPGroup = NULL_TP_GROUP,
        ep_size: int = 1,
    ) -> None:
        super().__init__()
        self.spec, self.tp_group = spec, tp_group
        self.gate = TopKRouter(spec.router, hidden_size, dtype=dtype, device=device)
        self.experts = FusedExperts(
            spec.experts,
            hidden_size,
            dtype=dtype,
            device=device,
            tp_group=tp_group,
            ep_size=ep_size,
        )
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared is not None:
            kw = dict(dtype=dtype, device=device)
            self.shared_expert = SharedExpert(spec.shared, hidden_size, tp_group=tp_group, **kw)
            if spec.shared.gated:
                self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.tp_group.all_reduce(out) if self.tp_group.size > 1 else out
