"""Norms of q and k before RoPE, in the three scopes families use.

| scope          | what is normalised, and its weight                   | families            |
|----------------|------------------------------------------------------|---------------------|
| `head`         | each head's dims; one weight `[head_dim]` for all    | Qwen3, Phi, Gemma 3 |
| `head_weights` | each head's dims; a weight row per head `[H, D]`     | Cohere, StableLM    |
| `proj`         | the whole q (or k) projection `[H * D]` at once      | OLMo 2              |

Under tensor parallelism a rank holds the rows of its heads (`head_start` on); the `proj`
scope sums its squares over the ranks (one all-reduce), so the statistics are the full
projection's. A rank that holds a replicated KV head counts it as often as it is replicated,
which leaves the mean unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sglite.distributed import NULL_TP_GROUP, TPGroup
from sglite.layers.layernorm import NormSpec
from sglite.layers.linear import loader_of
from sglite.layers.module import DirectCall
from sglite.layers.rotary_embedding import permute_heads

QK_NORM_SCOPES = ("head", "head_weights", "proj")


@dataclass(frozen=True)
class QKNormSpec:
    scope: str
    norm: NormSpec

    def __post_init__(self) -> None:
        if self.scope not in QK_NORM_SCOPES:
            raise ValueError(f"q/k norm scope {self.scope!r} is not one of {QK_NORM_SCOPES}")
        if self.scope == "proj" and self.norm.kind != "rms":
            raise ValueError("a q/k norm over the whole projection is an RMSNorm")
        if self.scope == "head_weights" and self.norm.kind not in ("layer", "layer_nobias"):
            raise ValueError("a q/k norm with a weight per head is a LayerNorm")

    def build(
        self,
        num_heads: int,
        total_heads: int,
        head_dim: int,
        head_start: int,
        *,
        dtype: torch.dtype,
        device,
        tp_group: TPGroup = NULL_TP_GROUP,
    ) -> nn.Module:
        """The norm of this rank's `num_heads` of `total_heads` heads, the first one being
        `head_start`."""
        if self.scope == "head":
            return self.norm.build(head_dim, dtype, device)
        rows = (head_start, num_heads, total_heads)
        if self.scope == "head_weights":
            return PerHeadNorm(rows, head_dim, self.norm, dtype, device)
        return ProjectionNorm(rows, head_dim, self.norm.eps, dtype, device, tp_group)


def permute_on_load(module: nn.Module, perm: torch.Tensor, head_dim: int) -> None:
    """Permute the dims of each head of every parameter of `module` as it loads."""
    for param in module.parameters():
        inner = loader_of(param)

        def load(p, loaded, shard_id=None, inner=inner):
            inner(p, permute_heads(loaded, perm, head_dim, -1), shard_id)

        param.weight_loader = load


class PerHeadNorm(DirectCall, nn.Module):
    """LayerNorm over each head's dims with a weight (and bias) row per head. Loads the full
    `[heads, head_dim]` tensor, or one head's row with its index as the shard id (StableLM
    stores `norms.<head>.weight`)."""

    def __init__(self, rows, head_dim, norm: NormSpec, dtype, device) -> None:
        super().__init__()
        self.head_start, num_heads, self.total_heads = rows
        self.head_dim, self.eps = head_dim, norm.eps
        shape = (num_heads, head_dim)
        self.weight = nn.Parameter(torch.ones(shape, dtype=dtype, device=device), False)
        self.bias = None
        if norm.kind == "layer":
            self.bias = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), False)
        for param in self.parameters():
            param.weight_loader = self.weight_loader
            param.shard_ids = tuple(range(self.total_heads))  # or all at once (shard id None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        heads, dim = param.shape
        if isinstance(shard_id, int):  # one head's row
            row = shard_id - self.head_start
            if loaded.shape != (dim,):
                raise ValueError(f"per-head norm row has shape {tuple(loaded.shape)}, not ({dim},)")
            if 0 <= row < heads:
                param.data[row].copy_(loaded)
            return
        if loaded.shape != (self.total_heads, dim):
            raise ValueError(
                f"per-head norm weight has shape {tuple(loaded.shape)}, the model expects "
                f"({self.total_heads}, {dim})"
            )
        param.data.copy_(loaded.narrow(0, self.head_start, heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, heads, head_dim]`."""
        out = F.layer_norm(x.float(), (self.head_dim,), None, None, self.eps) * self.weight.float()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)


class ProjectionNorm(DirectCall, nn.Module):
    """RMSNorm over a whole projection `[T, heads * head_dim]` (this rank's heads)."""

    def __init__(self, rows, head_dim, eps, dtype, device, tp_group) -> None:
        super().__init__()
        head_start, num_heads, total_heads = rows
        self.size, self.eps, self.tp_group = num_heads * head_dim, eps, tp_group
        self.start, self.total = head_start * head_dim, total_heads * head_dim
        self.weight = nn.Parameter(torch.ones(self.size, dtype=dtype, device=device), False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape != (self.total,):
            raise ValueError(
                f"q/k norm weight has shape {tuple(loaded.shape)}, the model expects "
                f"({self.total},)"
            )
        param.data.copy_(loaded.narrow(0, self.start, self.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.tp_group.size == 1:
            return F.rms_norm(xf, (self.size,), self.weight.float(), self.eps).to(x.dtype)
        squares = self.tp_group.all_reduce(xf.square().sum(-1, keepdim=True))
        mean = squares / (self.size * self.tp_group.size)
        return (xf * torch.rsqrt(mean + self.eps) * self.weight.float()).to(x.dtype)
