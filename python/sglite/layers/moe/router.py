"""The MoE router: each token's k experts and their weights, from the gate's logits.

`RouterSpec` declares a family's routing; `select_experts` is the math, `TopKRouter` the
module holding the gate's weights (replicated on every rank). The variants:

| step            | options (config fields)                         | families                 |
|-----------------|-------------------------------------------------|--------------------------|
| scores          | softmax or sigmoid of the logits (`scoring_func`) | softmax: most; sigmoid: DeepSeek-V3 |
| order           | score all then top-k; or top-k of the logits, softmax over those k (`softmax_after_topk`) | gpt-oss |
| choice bias     | `e_score_correction_bias` added to the scores for choosing only, never to the weights | DeepSeek-V3 (noaux_tc) |
| groups          | experts in `n_group` groups; only the `topk_group` best groups may be chosen; a group's score is its best expert (`max`, group_limited_greedy) or the sum of its best two (`top2_sum`, noaux_tc) | DeepSeek-V2/V3 |
| renormalise     | the k weights divided by their sum (`norm_topk_prob`) | Mixtral (always), Qwen3-MoE |
| scale           | weights times `routed_scaling_factor`           | DeepSeek                 |
| gate bias       | a bias on the gate's linear                     | gpt-oss                  |

Mixtral's renormalised softmax and gpt-oss's softmax over the top-k logits are the same
function; they differ in the last float bit, so each family picks the order transformers
runs. Ids are global expert ids (0..num_experts-1), whatever experts a rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2_sum")


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    softmax_after_topk: bool = False
    renormalize: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    correction_bias: bool = False
    scaling_factor: float = 1.0
    bias: bool = False
    fp32_gate: bool = False  # DeepSeek: the gate's weight and matmul in float32

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"router scoring {self.scoring!r} is not one of {SCORINGS}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group score {self.group_score!r} is not one of {GROUP_SCORES}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be in 1..num_experts={self.num_experts}"
            )
        if self.softmax_after_topk and (self.scoring != "softmax" or self.grouped):
            raise ValueError("softmax after top-k takes plain softmax routing (no groups)")
        if self.num_experts % self.num_groups:
            raise ValueError(
                f"n_group={self.num_groups} does not divide num_experts={self.num_experts}"
            )
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(
                f"topk_group={self.topk_groups} must be in 1..n_group={self.num_groups}"
            )
        if self.top_k > self.topk_groups * self.experts_per_group:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} exceeds the {self.topk_groups} group(s) x "
                f"{self.experts_per_group} experts a token may choose from"
            )
        if self.grouped and self.group_score == "top2_sum" and self.experts_per_group < 2:
            raise ValueError("a top2_sum group score needs at least 2 experts per group")

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.num_groups

    @property
    def grouped(self) -> bool:
        return self.topk_groups < self.num_groups


def _group_mask(choice: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """[T, E] bool: the experts of each token's `topk_groups` best groups."""
    groups = choice.view(choice.shape[0], spec.num_groups, spec.experts_per_group)
    if spec.group_score == "max":
        group_scores = groups.amax(dim=-1)
    else:
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
    best = group_scores.topk(spec.topk_groups, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return mask.unsqueeze(-1).expand_as(groups).reshape(choice.shape)


def select_experts(
    logits: torch.Tensor, spec: RouterSpec, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k] int64) from the gate's logits [T, E]."""
    logits = logits.float()
    if spec.softmax_after_topk:
        values, ids = logits.topk(spec.top_k, dim=-1)
        weights = values.softmax(dim=-1)
    else:
        scores = logits.softmax(dim=-1) if spec.scoring == "softmax" else logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if spec.grouped:
            choice = choice.masked_fill(~_group_mask(choice, spec), float("-inf"))
        ids = choice.topk(spec.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if spec.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if spec.scaling_factor != 1.0:
        weights = weights * spec.scaling_factor
    return weights, ids


class TopKRouter(nn.Module):
    """The gate: `weight [E, H]` (+ `bias [E]`, + `e_score_correction_bias [E]`), the same
    on every rank. Checkpoint names: `<block>.gate.weight`, `.bias`, `.e_score_correction_bias`."""

    def __init__(
        self,
        spec: RouterSpec,
        hidden_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        dtype = torch.float32 if spec.fp32_gate else dtype
        e = spec.num_experts

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

        self.weight = param(e, hidden_size)
        self.bias = param(e) if spec.bias else None
        # float32 as DeepSeek-V3 keeps it: a bias near 1 in bf16 would move choices
        self.e_score_correction_bias = None
        if spec.correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(e, dtype=torch.float32, device=device), requires_grad=False
            )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.fp32_gate:
            x = x.float()
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, global expert ids [T, k]) of tokens `x [T, H]`."""
        return select_experts(self.logits(x), self.spec, self.e_score_correction_bias)
