"""RMSNorm, with the residual add fused in front (the decoder layers' pre-norm pattern)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglite.layers import cpu_ops


class RMSNorm(nn.Module):
    """`x / rms(x) * weight`, computed in float32 like transformers, cast back before the weight."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        normed = F.rms_norm(x.float(), (self.hidden_size,), None, self.eps)
        return normed.to(x.dtype) * self.weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual); on the
        CPU the sum may be written into `residual` itself (callers pass a temporary)."""
        out = cpu_ops.rms_norm(x, self.weight, self.eps, residual)
        if out is not None:
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
