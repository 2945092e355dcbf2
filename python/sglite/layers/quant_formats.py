"""The GGUF block formats in plain torch and numpy: the geometry table, dequantization
(any device: the CUDA path and the reference of the native kernels) and quantization (for
tests and for writing GGUF files: `benches/make_gguf.py`).

A weight `[rows, in_features]` is `rows` rows of `in_features / block_len` blocks, each block
`block_bytes` bytes, exactly as in a GGUF file; rust/quant/src/format.rs documents each
layout. Dequantization follows gguf-py's arithmetic operation by operation, so it equals
`gguf.quants.dequantize` bit for bit. Quantization of the 32-weight types is gguf-py's
(llama.cpp's reference rounding); the k-quants, which gguf-py cannot write, use a plain
min/max fit per sub-block (not llama.cpp's searched scales: fine for tests and random
weights, a little less accurate on real ones).
"""

from __future__ import annotations

import numpy as np
import torch

# name -> (weights per block, bytes per block, GGML type id)
QUANT_TYPES: dict[str, tuple[int, int, int]] = {
    "Q8_0": (32, 34, 8),
    "Q4_0": (32, 18, 2),
    "Q4_1": (32, 20, 3),
    "Q5_0": (32, 22, 6),
    "Q5_1": (32, 24, 7),
    "Q4_K": (256, 144, 12),
    "Q5_K": (256, 176, 13),
    "Q6_K": (256, 210, 14),
}


def block_len(qtype: str) -> int:
    return QUANT_TYPES[qtype][0]


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one row; ValueError unless `in_features` is a positive multiple of the block."""
    length, size, _ = QUANT_TYPES[qtype]
    if in_features <= 0 or in_features % length:
        raise ValueError(
            f"in_features={in_features} is not a positive multiple of {qtype}'s block of {length}"
        )
    return in_features // length * size


def _half(b: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 at byte `at` of each block, as float32 `[..., 1]`."""
    return b[..., at : at + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 levels: the low nibbles, then the high ones."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _shifts(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=like.device)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes (a little-endian u32) -> 32 values, 16 where the weight's bit is set."""
    bits = (qh.unsqueeze(-1) >> _shifts(list(range(8)), qh)) & 1
    return bits.flatten(-2) << 4


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes -> 8 six-bit scales and 8 six-bit mins."""
    lo, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (top & 0xF) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([mid & 63, (top >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc.to(torch.float32), mn.to(torch.float32)


def _dequantize_blocks(qtype: str, b: torch.Tensor) -> torch.Tensor:
    """`b` uint8 `[..., block_bytes]` -> float32 `[..., block_len]`."""
    q8 = b.to(torch.int32)
    if qtype == "Q8_0":
        return _half(b, 0) * b[..., 2:].contiguous().view(torch.int8).to(torch.float32)
    if qtype in ("Q4_0", "Q4_1"):
        q = _nibbles(q8[..., 2 if qtype == "Q4_0" else 4 :])
        if qtype == "Q4_0":
            return _half(b, 0) * (q - 8).to(torch.float32)
        return _half(b, 0) * q.to(torch.float32) + _half(b, 2)
    if qtype in ("Q5_0", "Q5_1"):
        at = 2 if qtype == "Q5_0" else 4
        q = _nibbles(q8[..., at + 4 :]) | _fifth_bits(q8[..., at : at + 4])
        if qtype == "Q5_0":
            return _half(b, 0) * (q - 16).to(torch.float32)
        return _half(b, 0) * q.to(torch.float32) + _half(b, 2)
    if qtype in ("Q4_K", "Q5_K"):
        sc, mn = _k4_scales(q8[..., 4:16])
        qs = q8[..., 48:] if qtype == "Q5_K" else q8[..., 16:]
        qs = qs.unflatten(-1, (4, 1, 32)) >> _shifts([0, 4], qs).view(2, 1)
        q = (qs & 0xF).flatten(-3, -2)  # [..., 8, 32]
        if qtype == "Q5_K":
            qh = q8[..., 16:48].unsqueeze(-2) >> _shifts(list(range(8)), qs).view(8, 1)
            q = q | ((qh & 1) << 4)
        d = (_half(b, 0) * sc).unsqueeze(-1)
        m = (_half(b, 2) * mn).unsqueeze(-1)
        return (d * q.to(torch.float32) - m).flatten(-2)
    if qtype == "Q6_K":
        ql = q8[..., :128].unflatten(-1, (2, 64))
        ql = torch.cat([ql & 0xF, ql >> 4], dim=-1).unflatten(-1, (4, 32))  # [..., 2, 4, 32]
        qh = q8[..., 128:192].unflatten(-1, (2, 1, 32)) >> _shifts([0, 2, 4, 6], ql).view(4, 1)
        q = ((ql | ((qh & 3) << 4)) - 32).flatten(-3).unflatten(-1, (16, 16))
        sc = b[..., 192:208].contiguous().view(torch.int8).to(torch.float32)
        d = (_half(b, 208) * sc).unsqueeze(-1)
        return (d * q.to(torch.float32)).flatten(-2)
    raise ValueError(f"quant type {qtype!r}: one of {', '.join(QUANT_TYPES)}")


def dequantize(qtype: str, data: torch.Tensor, in_features: int) -> torch.Tensor:
    """uint8 `[rows, row_bytes]` of `qtype` blocks -> float32 `[rows, in_features]`, on the
    tensor's device."""
    if qtype not in QUANT_TYPES:
        raise ValueError(f"quant type {qtype!r}: one of {', '.join(QUANT_TYPES)}")
    need = row_bytes(qtype, in_features)
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != need:
        raise ValueError(
            f"{qtype} data must be uint8 [rows, {need}], got {data.dtype} {tuple(data.shape)}"
        )
    blocks = data.reshape(data.shape[0], -1, QUANT_TYPES[qtype][1])
    return _dequantize_blocks(qtype, blocks).reshape(data.shape[0], in_features)


def quantize(qtype: str, weight: np.ndarray) -> np.ndarray:
    """float32 `[rows, in_features]` -> uint8 `[rows, row_bytes]` of `qtype` blocks."""
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D, got shape {weight.shape}")
    row_bytes(qtype, weight.shape[1])
    if block_len(qtype) == 32:
        from gguf import GGMLQuantizationType, quants

        return quants.quantize(weight, GGMLQuantizationType[qtype])
    from sglite.layers.quant_kquants import quantize_k

    return quantize_k(qtype, weight)
