"""The decoder's norms (RMSNorm, Gemma's (1 + w) RMSNorm, LayerNorm with or without its
affine parts), each with the residual add fused in front (the pre-norm pattern).

Every norm takes `(x)` -> `norm(x)` or `(x, residual)` -> `(norm(x + residual), x + residual)`.
A `NormSpec` names the kind a model family uses:

| kind            | formula (over the last dim)                        | families             |
|-----------------|----------------------------------------------------|----------------------|
| `rms`           | `x / rms(x) * w`                                   | Llama, Qwen, Phi-3.. |
| `rms_offset`    | `x / rms(x) * (1 + w)` (the checkpoint stores w)   | Gemma                |
| `layer`         | `(x - mean) / std * w + b`                         | GPT-NeoX, Phi, ...   |
| `layer_nobias`  | `(x - mean) / std * w`                             | Cohere, StableLM q/k |
| `layer_noparam` | `(x - mean) / std`                                 | OLMo                 |

Statistics are computed in float32 like transformers and cast back to the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sglite.layers import cpu_ops
from sglite.layers.module import DirectCall

NORM_KINDS = ("rms", "rms_offset", "layer", "layer_nobias", "layer_noparam")


def _ones(size: int | tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)


class _ResidualNorm(DirectCall, nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class RMSNorm(_ResidualNorm):
    """`x / rms(x) * weight`, computed in float32 like transformers, cast back before the weight."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(hidden_size, eps)
        self.weight = _ones(hidden_size, dtype, device)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        normed = F.rms_norm(x.float(), (self.hidden_size,), None, self.eps)
        return normed.to(x.dtype) * self.weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As the base class; on the CPU the sum may be written into `residual` itself
        (callers pass a temporary). A strided x (q/k norms over a view of the QKV output)
        is copied first, so that the native kernel, the one the native decode step runs,
        normalises it."""
        if residual is None and x.device.type == "cpu" and not x.is_contiguous():
            x = x.contiguous()
        out = cpu_ops.rms_norm(x, self.weight, self.eps, residual)
        if out is not None:
            return out if residual is None else (out, residual)
        return super().forward(x, residual)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm, `x / rms(x) * (1 + w)`: the weight holds `1 + w` once loaded."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.weight.weight_loader = self.weight_loader

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.shape != loaded.shape:
            raise ValueError(
                f"norm weight has shape {tuple(loaded.shape)}, the model expects {tuple(param.shape)}"
            )
        param.data.copy_(loaded.float() + 1.0)


class LayerNorm(_ResidualNorm):
    """`(x - mean) / sqrt(var + eps)`, times `weight` (if `affine`), plus `bias` (if `bias`)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        *,
        affine: bool = True,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(hidden_size, eps)
        self.weight = _ones(hidden_size, dtype, device) if affine else None
        self.bias = None
        if affine and bias:
            self.bias = nn.Parameter(
                torch.zeros(hidden_size, dtype=dtype, device=device), requires_grad=False
            )

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), (self.hidden_size,), w, b, self.eps).to(x.dtype)


@dataclass(frozen=True)
class NormSpec:
    """A family's norm: its kind (see the module docstring) and epsilon."""

    kind: str
    eps: float

    def __post_init__(self) -> None:
        if self.kind not in NORM_KINDS:
            raise ValueError(f"norm kind {self.kind!r} is not one of {', '.join(NORM_KINDS)}")

    def build(self, size: int, dtype: torch.dtype, device) -> nn.Module:
        kwargs = dict(dtype=dtype, device=device)
        if self.kind == "rms":
            return RMSNorm(size, self.eps, **kwargs)
        if self.kind == "rms_offset":
            return OffsetRMSNorm(size, self.eps, **kwargs)
        affine, bias = self.kind != "layer_noparam", self.kind == "layer"
        return LayerNorm(size, self.eps, affine=affine, bias=bias, **kwargs)
