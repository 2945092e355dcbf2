"""Expert compute over stacked weights: tokens grouped by expert, one matmul pair per expert.

`group_by_expert` sorts the flattened (token, slot) pairs of the router's top-k by expert
(one stable argsort), so each expert's tokens are one contiguous block of rows;
`grouped_forward` gathers the tokens once, runs each expert that has tokens over its block
(one gate/up matmul, the activation, one down matmul: the per-expert weights are oneDNN
packed on CPU, see FusedExperts.prepack), scales the rows by their routing weights and
scatter-adds them back to their tokens. Python loops over the experts that have tokens,
never over tokens. One host sync per layer (the per-expert counts), cheap on CPU.

`single_token_forward` is the batch-1 decode path: the token's k experts in turn, with
no sort. `masked_forward` is the sync-free form for devices other than the CPU and CUDA (CUDA runs
the Triton fused-MoE kernels, `fused_triton.py`): every local expert runs over every token, the rows of
tokens that did not choose it weighted 0. `naive_forward` is transformers' loop (a mask
per expert, all experts in turn) over plain weights: the reference of tests and benches.

Expert ids outside the rank's range [expert_start, expert_start + num_local) are dropped
(another rank holds those experts; the block's all-reduce adds their share).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# (local expert index, its tokens' rows [n, H]) -> the expert's output rows [n, H]
RunExpert = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass
class ExpertGroups:
    """The router's choices, sorted by local expert."""

    token_idx: torch.Tensor  # [N] the token of each row
    weights: torch.Tensor  # [N, 1] float32 routing weight of each row
    counts: list[int]  # rows of each local expert, in expert order (sum N)


def group_by_expert(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_start: int,
    num_local: int,
    num_experts: int | None = None,
) -> ExpertGroups:
    """`num_experts`: the model's; when this rank holds them all, no id needs dropping."""
    top_k = topk_ids.shape[1]
    local = topk_ids.reshape(-1)
    if num_experts is None or num_local < num_experts:
        # experts of other ranks go to bucket num_local, sorted last and cut off
        local = local - expert_start
        local = torch.where((local >= 0) & (local < num_local), local, num_local)
    order = local.argsort(stable=True)
    counts = torch.bincount(local, minlength=num_local + 1)[:num_local].tolist()
    order = order[: sum(counts)]
    weights = topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)
    return ExpertGroups(order.div(top_k, rounding_mode="floor"), weights, counts)


def grouped_forward(x: torch.Tensor, groups: ExpertGroups, run_expert: RunExpert) -> torch.Tensor:
    """Sum over each token's local experts of weight * expert(token): `[T, H]`."""
    out = torch.zeros_like(x)
    if not groups.counts or not sum(groups.counts):
        return out
    rows = x.index_select(0, groups.token_idx)
    outs, start = [], 0
    for e, n in enumerate(groups.counts):
        if n:
            outs.append(run_expert(e, rows[start : start + n]))
            start += n
    weighted = torch.cat(outs) if len(outs) > 1 else outs[0]
    weighted = weighted * groups.weights.to(weighted.dtype)
    return out.index_add_(0, groups.token_idx, weighted)


def single_token_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_start: int,
    num_local: int,
    run_expert: RunExpert,
) -> torch.Tensor:
    """One token (batch-1 decode): its k experts in turn, in expert order like the grouped
    path, without the sort, gathers and scatter that only pay with many tokens."""
    out = torch.zeros_like(x)
    for e, weight in sorted(zip(topk_ids[0].tolist(), topk_weights[0].tolist())):
        local = e - expert_start
        if 0 <= local < num_local:
            out.add_(run_expert(local, x), alpha=weight)
    return out


def masked_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_start: int,
    num_local: int,
    run_expert: RunExpert,
) -> torch.Tensor:
    """The same sum with no host sync: every local expert over every token."""
    out = torch.zeros_like(x)
    for e in range(num_local):
        chosen = topk_ids == expert_start + e
        weight = (topk_weights * chosen).sum(dim=-1, keepdim=True)
        out += run_expert(e, x) * weight.to(x.dtype)
    return out


def naive_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> torch.Tensor:
    """transformers' expert loop over plain stacked weights `w13 [E, 2I, H]`, `w2 [E, H, I]`:
    each expert in turn finds its tokens with a mask and runs over them."""
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token_idx, slot = torch.where(topk_ids == e)
        if token_idx.numel() == 0:
            continue
        gate, up = F.linear(x[token_idx], w13[e]).chunk(2, dim=-1)
        rows = F.linear(act(gate) * up, w2[e]) * topk_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, rows.to(x.dtype))
    return out
