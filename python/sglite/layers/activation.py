"""Activations by their transformers `hidden_act` name, plain and gated (act(gate) * up).

A gated MLP's merged projection is `[gate | up]`; `GatedActivation` returns
`act(gate) * up`. SiLU (SwiGLU) and the tanh GELU (GeGLU, Gemma's `gelu_pytorch_tanh`) run
through the native CPU kernels where they apply (sglite.layers.cpu_ops). transformers' names
that compute the same function share one entry: `gelu_new`, `gelu_fast`, `gelu_accurate`
and `gelu_python_tanh` are all the tanh approximation (they differ in the last float bit).
A name outside `ACTIVATIONS` is refused when the model is built, never replaced by SiLU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sglite.layers import cpu_ops
from sglite.layers.module import DirectCall


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_python": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_accurate": _gelu_tanh,
    "gelu_python_tanh": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "relu2": _relu2,
}
# the native gated kernels: activation name -> cpu_ops function
_NATIVE_GATED = {
    "silu": cpu_ops.silu_and_mul,
    "swish": cpu_ops.silu_and_mul,
    **{name: cpu_ops.gelu_tanh_and_mul for name, fn in ACTIVATIONS.items() if fn is _gelu_tanh},
}


def check_activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(
            f"hidden_act={name!r} is not implemented; sglite implements "
            + ", ".join(sorted(ACTIVATIONS))
        )
    return name


class Activation(DirectCall, nn.Module):
    """`act(x)`, element-wise."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = check_activation(name)
        self.fn = ACTIVATIONS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class GatedActivation(DirectCall, nn.Module):
    """`[..., 2d] -> [..., d]`: act of the first half times the second half."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = check_activation(name)
        self.fn = ACTIVATIONS[name]
        self.native = _NATIVE_GATED.get(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            out = self.native(x)
            if out is not None:
                return out
        d = x.shape[-1] // 2
        return self.fn(x[..., :d]).mul_(x[..., d:])


class SiluAndMul(GatedActivation):
    """SwiGLU's `silu(gate) * up`."""

    def __init__(self) -> None:
        super().__init__("silu")
