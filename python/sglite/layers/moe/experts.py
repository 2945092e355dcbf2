"""Routed experts as stacked weights: `w13 [E, 2I, H]` (gate | up) and `w2 [E, H, I]`.

`ExpertsSpec` declares what a family's experts compute; `ExpertShard` what one rank holds:
under tensor parallelism each rank keeps every expert's 1/tp slice of the intermediate dim
(the gate/up rows and the down columns of that slice) and its output is a partial sum that
the MoE block all-reduces once. Expert parallelism (`ep_size` > 1, dividing tp_size) gives
each group of tp/ep ranks a contiguous range of E/ep experts, split inside the group the
same way; the same one all-reduce sums the groups. The forward only ever sees local experts
[expert_start, expert_start + num_local).

Checkpoint forms the loader takes (our names `experts.w13_weight`, `w2_weight`,
`w13_bias`, `w2_bias`; shard ids `(expert, "gate" | "up" | "down")`):
- per expert, as transformers 5 saves and the Hub holds Qwen-MoE, OLMoE, DeepSeek, Mixtral
  (after the family renames w1/w3/w2): `experts.{e}.gate_proj/up_proj/down_proj.weight`;
- fused `stacked` (transformers 5's in-memory layout): `experts.gate_up_proj [E, 2I, H]`
  (gate rows first), `experts.down_proj [E, H, I]`, `*_bias [E, 2I]`, `[E, H]`;
- fused `gpt_oss`: `gate_up_proj [E, H, 2I]` with gate and up interleaved (even / odd
  columns), `down_proj [E, I, H]`, the biases interleaved the same way.

Activations: any gated `hidden_act` (act(gate) * up), or gpt-oss's `clamped_swiglu`:
`(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)` with `g = clamp(gate, max=l)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sglite.distributed import NULL_TP_GROUP, TPGroup
from sglite.layers.activation import GatedActivation, check_activation
from sglite.layers.linear import _copy_checked, can_prepack
from sglite.layers.moe.fused_cpu import (
    group_by_expert,
    grouped_forward,
    masked_forward,
    single_token_forward,
)

FUSED_FORMS = ("stacked", "gpt_oss")
CLAMPED_SWIGLU = "clamped_swiglu"


@dataclass(frozen=True)
class ExpertsSpec:
    num_experts: int
    intermediate_size: int  # each expert's (moe_intermediate_size)
    act: str = "silu"
    swiglu_alpha: float = 1.702  # clamped_swiglu only
    swiglu_limit: float = 7.0
    bias: bool = False  # gate/up and down biases (gpt-oss)
    fused_form: str = "stacked"

    def __post_init__(self) -> None:
        if self.act != CLAMPED_SWIGLU:
            check_activation(self.act)
        if self.fused_form not in FUSED_FORMS:
            raise ValueError(f"fused expert form {self.fused_form!r} is not one of {FUSED_FORMS}")


@dataclass(frozen=True)
class ExpertShard:
    expert_start: int
    num_local: int
    inter_start: int
    inter_size: int
    adds_down_bias: bool  # the first rank of its expert group adds the down biases, once

    def is_local(self, expert: int) -> bool:
        return self.expert_start <= expert < self.expert_start + self.num_local


def expert_shard(spec: ExpertsSpec, tp_size: int, tp_rank: int, ep_size: int = 1) -> ExpertShard:
    """Rank `tp_rank`'s experts and intermediate slice; ranks r..r+tp/ep-1 share experts."""
    if ep_size < 1 or tp_size % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide tp_size={tp_size}")
    if spec.num_experts % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide num_experts={spec.num_experts}")
    inner = tp_size // ep_size
    if spec.intermediate_size % inner:
        raise ValueError(
            f"moe_intermediate_size={spec.intermediate_size} is not divisible by "
            f"tp_size / ep_size = {inner}"
        )
    ep_rank, inner_rank = divmod(tp_rank, inner)
    num_local, size = spec.num_experts // ep_size, spec.intermediate_size // inner
    return ExpertShard(ep_rank * num_local, num_local, inner_rank * size, size, inner_rank == 0)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class FusedExperts(nn.Module):
    """This rank's experts; `forward(x, topk_ids, topk_weights)` is its partial sum."""

    def __init__(
        self,
        spec: ExpertsSpec,
        hidden_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | None = None,
        tp_group: TPGroup = NULL_TP_GROUP,
        ep_size: int = 1,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.shard = s = expert_shard(spec, tp_group.size, tp_group.rank, ep_size)
        e, i, h = s.num_local, s.inter_size, hidden_size

        def param(shape: tuple[int, ...], loader, shard_ids: tuple) -> nn.Parameter:
            p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
            p.weight_loader, p.shard_ids = loader, shard_ids
            return p

        experts = range(s.expert_start, s.expert_start + e)
        gate_up = tuple((x, part) for x in experts for part in ("gate", "up"))
        down = tuple((x, "down") for x in experts)
        self.w13_weight = param((e, 2 * i, h), self._load_w13, gate_up)
        self.w2_weight = param((e, h, i), self._load_w2, down)
        self.w13_bias = self.w2_bias = None
        if spec.bias:
            self.w13_bias = param((e, 2 * i), self._load_w13, gate_up)
            self.w2_bias = param((e, h), self._load_w2, down)
        if spec.act == CLAMPED_SWIGLU:
            alpha, limit = spec.swiglu_alpha, spec.swiglu_limit
            self.act_fn = lambda x: clamped_swiglu(x, alpha, limit)
        else:
            self.act_fn = GatedActivation(spec.act)
        self._packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        # graph-capturing devices cannot sync on the per-expert counts
        self._grouped = device is None or torch.device(device).type == "cpu"

    # ------------------------------------------------------------------ loading
    def _local(self, expert: int) -> int | None:
        return expert - self.shard.expert_start if self.shard.is_local(expert) else None

    def _inter(self, t: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        """This rank's slice of a full expert tensor's intermediate dim."""
        if t.dim() <= dim or t.shape[dim] != self.spec.intermediate_size:
            raise ValueError(
                f"{what}: checkpoint tensor has shape {tuple(t.shape)}, the model expects "
                f"moe_intermediate_size={self.spec.intermediate_size} along dim {dim}"
            )
        return t.narrow(dim, self.shard.inter_start, self.shard.inter_size)

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """One expert's gate or up (`[I, H]` weight, `[I]` bias), or the fused tensor."""
        if shard_id is None:
            gate, up = self._split_fused_gate_up(loaded, param.dim() == 3)
            for expert in range(gate.shape[0]):
                self._load_w13(param, gate[expert], (expert, "gate"))
                self._load_w13(param, up[expert], (expert, "up"))
            return
        expert, part = shard_id
        local = self._local(expert)
        if local is None:
            return  # another rank's expert
        i = self.shard.inter_size
        offset = {"gate": 0, "up": i}[part]
        what = f"expert {expert} {part}_proj"
        _copy_checked(param.data[local].narrow(0, offset, i), self._inter(loaded, 0, what), what)

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """One expert's down (`[H, I]` weight, `[H]` bias), or the fused tensor."""
        if shard_id is None:
            if self.spec.fused_form == "gpt_oss" and param.dim() == 3:
                loaded = loaded.transpose(1, 2)  # [E, I, H] -> [E, H, I]
            for expert in range(loaded.shape[0]):
                self._load_w2(param, loaded[expert], (expert, "down"))
            return
        expert, _ = shard_id
        local = self._local(expert)
        if local is None:
            return
        what = f"expert {expert} down_proj"
        src = self._inter(loaded, 1, what) if param.dim() == 3 else loaded
        _copy_checked(param.data[local], src, what)

    def _split_fused_gate_up(
        self, loaded: torch.Tensor, is_weight: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate [E, I(, H)], up [E, I(, H)]) of a fused checkpoint tensor."""
        if self.spec.fused_form == "gpt_oss":
            if is_weight:
                loaded = loaded.transpose(1, 2)  # [E, H, 2I] -> [E, 2I, H]
            return loaded[:, 0::2], loaded[:, 1::2]
        if loaded.shape[1] % 2:
            raise ValueError(f"fused experts.gate_up_proj has an odd dim 1: {tuple(loaded.shape)}")
        return loaded.chunk(2, dim=1)

    # ------------------------------------------------------------------ compute
    def prepack(self) -> bool:
        """CPU: each expert's two weights in oneDNN's packed layout (the dense layers'
        prepack, see layers.linear); the stacked weights are dropped. Load weights first."""
        w13, w2 = self.w13_weight, self.w2_weight
        if w13.device.type != "cpu" or not can_prepack(w13.dtype):
            return False
        try:
            reorder = torch.ops.mkldnn._reorder_linear_weight
            packed = ([reorder(w.contiguous()) for w in w13], [reorder(w.contiguous()) for w in w2])
        except RuntimeError:
            return False
        self._packed = packed
        self.w13_weight = self.w2_weight = None
        return True

    def run_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert `e` over rows `x [n, H]`: its partial output `[n, H]`."""
        b13 = None if self.w13_bias is None else self.w13_bias[e]
        b2 = self.w2_bias[e] if self.w2_bias is not None and self.shard.adds_down_bias else None
        if self._packed is not None:
            p13, p2 = self._packed
            return _packed_linear(self.act_fn(_packed_linear(x, p13[e], b13)), p2[e], b2)
        return _linear(self.act_fn(_linear(x, self.w13_weight[e], b13)), self.w2_weight[e], b2)

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if x.is_cuda:  # the Triton fused-MoE kernels; imported here, so CPU runs skip triton
            from sglite.layers.moe.fused_triton import triton_forward

            return triton_forward(self, x, topk_ids, topk_weights)
        s = self.shard
        if not self._grouped:
            return masked_forward(
                x, topk_ids, topk_weights, s.expert_start, s.num_local, self.run_expert
            )
        if x.shape[0] == 1:
            return single_token_forward(
                x, topk_ids, topk_weights, s.expert_start, s.num_local, self.run_expert
            )
        num = self.spec.num_experts
        groups = group_by_expert(topk_ids, topk_weights, s.expert_start, s.num_local, num)
        return grouped_forward(x, groups, self.run_expert)
