"""RoPE frequencies: the inverse frequencies of each `rope_type` and its attention factor.

`rotary_dim` is the rotated part of a head (`int(head_dim * partial_rotary_factor)`), over
which the exponents are taken, as transformers does. Static types (`default`, `linear`,
`llama3`, `yarn`) give one set of frequencies; `longrope` gives a short and a long set, picked
by the request's length; `dynamic` (NTK) recomputes the base from the request's length once
it exceeds the model's `max_position_embeddings` (see `dynamic_inv_freq`). The attention
factor multiplies cos and sin (yarn's mscale, longrope's scaling), so it scales q.k by its
square, as in transformers.
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def check_rope_type(rope_scaling: dict[str, Any] | None) -> str:
    rope_type = rope_type_of(rope_scaling)
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling rope_type={rope_type!r} is not implemented; sglite implements "
            + ", ".join(ROPE_TYPES)
        )
    return rope_type


def _param(params: dict[str, Any], name: str) -> Any:
    if params.get(name) is None:
        raise ValueError(f"rope_scaling of type {rope_type_of(params)!r} needs {name!r}")
    return params[name]


def _exponents(rotary_dim: int) -> torch.Tensor:
    return torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim


def default_inv_freq(rotary_dim: int, base: float | torch.Tensor) -> torch.Tensor:
    return 1.0 / (base ** _exponents(rotary_dim))


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between blended."""
    factor = float(_param(params, "factor"))
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    old_len = float(_param(params, "original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    rotary_dim: int, base: float, params: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies blended between interpolated and extrapolated by a linear ramp over
    the dimensions; the attention factor from `attention_factor` or mscale(factor)."""
    orig = float(_param(params, "original_max_position_embeddings"))
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_positions / orig
    attention = params.get("attention_factor")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None:
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(torch.float32) / rotary_dim)
    inv_extrapolated, inv_interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    inv = inv_interpolated * (1 - extrapolation) + inv_extrapolated * extrapolation
    return inv, float(attention)


def static_inv_freq(
    rope_type: str, rotary_dim: int, base: float, params: dict[str, Any] | None, max_positions: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention factor) of a type whose frequencies do not depend on the length."""
    inv = default_inv_freq(rotary_dim, base)
    if rope_type == "linear":
        return inv / float(_param(params, "factor")), 1.0
    if rope_type == "llama3":
        return _llama3(inv, params), 1.0
    if rope_type == "yarn":
        return _yarn(rotary_dim, base, params, max_positions)
    return inv, 1.0


def longrope_inv_freq(
    rotary_dim: int, base: float, params: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(short inv_freq, long inv_freq, attention factor): `1 / (factor_i * base^(2i/d))` with
    the short or long per-dimension factors (Phi-3's `su` / `longrope`)."""
    orig = float(_param(params, "original_max_position_embeddings"))
    pairs = len(_exponents(rotary_dim))
    sets = []
    for name in ("short_factor", "long_factor"):
        factors = torch.tensor(_param(params, name), dtype=torch.float32)
        if factors.shape != (pairs,):
            raise ValueError(
                f"rope_scaling {name} has {factors.numel()} entries; the rotary part of a head "
                f"has {pairs} frequency pairs"
            )
        sets.append(1.0 / (factors * base ** _exponents(rotary_dim)))
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_positions / orig
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return sets[0], sets[1], float(attention)


def dynamic_exponents(rotary_dim: int) -> torch.Tensor:
    """The `2i / rotary_dim` that `dynamic_inv_freq` raises the base to."""
    return _exponents(rotary_dim)


def dynamic_inv_freq(
    rotary_dim: int,
    base: float,
    factor: float,
    max_positions: int,
    seq_lens: torch.Tensor,
    exponents: torch.Tensor,
) -> torch.Tensor:
    """Dynamic NTK: `[T, rotary_dim / 2]` inverse frequencies for tokens of requests of
    length `seq_lens` `[T]`: the base grows with a length past `max_positions`; a shorter
    request gets the plain frequencies. Tensor ops only (a CUDA graph may capture them)."""
    lens = seq_lens.to(torch.float32)
    scaled = base * ((factor * lens.clamp(min=max_positions) / max_positions) - (factor - 1)) ** (
        rotary_dim / (rotary_dim - 2)
    )
    scaled = torch.where(lens > max_positions, scaled, torch.full_like(scaled, base))
    return 1.0 / (scaled[:, None] ** exponents[None, :])
