"""Rotary position embedding (neox/half-split layout), with linear and Llama-3 frequency scaling.

One cos/sin table per model covers every position up to the context length; each forward
gathers the rows of its positions. Rotation of x = [x1 | x2] (halves of head_dim):
`x * [cos | cos] + [x2 | x1] * [-sin | sin]`, i.e. transformers' `x*cos + rotate_half(x)*sin`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from sglite.layers import cpu_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between blended."""
    factor = float(params["factor"])
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        rope_type = rope_type_of(rope_scaling)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        self.head_dim = head_dim
        inv_freq = _inv_freq(head_dim, base)
        positions = torch.arange(max_position, dtype=torch.float32)
        if rope_type == "linear":
            inv_freq = inv_freq / float(rope_scaling["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        freqs = torch.outer(positions, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        table = torch.cat([cos, cos, -sin, sin], dim=-1).to(dtype)
        self.register_buffer("cos_sin", table.to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q `[T, Hq, D]` and k `[T, Hkv, D]` at `positions` `[T]`; returns new tensors."""
        rotated = cpu_ops.rope(positions, q, k, self.cos_sin)
        if rotated is not None:
            return rotated
        cos_sin = self.cos_sin.index_select(0, positions).unsqueeze(1)
        cos, sin = cos_sin.split(self.head_dim, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        swapped = x.roll(self.head_dim // 2, dims=-1)
        return torch.addcmul(x * cos, swapped, sin)
