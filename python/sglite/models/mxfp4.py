"""MXFP4 checkpoint tensors (gpt-oss's experts), decoded to floats as they load.

The OCP microscaling format as gpt-oss checkpoints store it (`quantization_config.quant_method
== "mxfp4"`): a weight `W [..., R, C]` (R output rows, C input columns) is saved as two
tensors, `<name>_blocks` uint8 `[..., R, C / 32, 16]` and `<name>_scales` uint8
`[..., R, C / 32]`. Each block of 32 consecutive values along a row shares one scale, an
E8M0 exponent (the value `2 ** (scale - 127)`); each byte of the block holds two E2M1 values
(sign, 2 exponent bits, 1 mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}), the low nibble the
even column and the high nibble the odd one.

`decode_mxfp4(blocks, scales)` -> `[..., R, C]` float32 (exact: every product is a float32).
`Mxfp4Pairs` collects the two halves of each quantized tensor as the checkpoint yields them (in
any order, over shards) and hands back the decoded tensor under `<name>` once both are in.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale
SCALE_BIAS = 127  # E8M0: 2 ** (scale - 127)
# E2M1 by nibble: bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1 = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)
SUFFIXES = ("_blocks", "_scales")


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`blocks [..., G, 16]` uint8 and `scales [..., G]` uint8 -> `[..., G * 32]` float32."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: "
            f"blocks must be [..., G, {BLOCK // 2}] over scales [..., G]"
        )
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1)
    values = values.flatten(-2)  # [..., G, 32]: low nibble, high nibble, ...
    exponent = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponent.unsqueeze(-1)).flatten(-2)


class Mxfp4Pairs:
    """Blocks and scales seen so far, by the name of the tensor they encode."""

    def __init__(self) -> None:
        self._halves: dict[str, dict[str, torch.Tensor]] = {}

    @staticmethod
    def base_name(name: str) -> str | None:
        """`x.gate_up_proj` for `x.gate_up_proj_blocks` / `_scales`; None for other names."""
        for suffix in SUFFIXES:
            if name.endswith(suffix):
                return name.removesuffix(suffix)
        return None

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Keep one half; once both halves of `<base>` are in, `(<base>, [..., R, C] float32)`."""
        base = self.base_name(name)
        if base is None:
            raise ValueError(f"{name!r} is not an MXFP4 blocks or scales tensor")
        halves = self._halves.setdefault(base, {})
        halves[name.removeprefix(base)] = tensor
        if len(halves) < 2:
            return None
        del self._halves[base]
        try:
            return base, decode_mxfp4(halves["_blocks"], halves["_scales"])
        except ValueError as e:
            raise ValueError(f"{base}: {e}") from None

    def check_complete(self) -> None:
        """Every blocks tensor met its scales (call after the last checkpoint tensor)."""
        if self._halves:
            lone = [f"{base}{next(iter(h))}" for base, h in sorted(self._halves.items())]
            raise ValueError(
                f"MXFP4 checkpoint: {len(lone)} tensor(s) lack their other half "
                f"(_blocks or _scales), e.g. {', '.join(lone[:3])}"
            )
