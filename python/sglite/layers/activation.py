"""Gated activations: SiLU(gate) * up over the merged [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglite.layers import cpu_ops


class SiluAndMul(nn.Module):
    """`[..., 2d] -> [..., d]`: silu of the first half times the second half."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu_ops.silu_and_mul(x)
        if out is not None:
            return out
        d = x.shape[-1] // 2
        out = F.silu(x[..., :d])
        return out.mul_(x[..., d:])
