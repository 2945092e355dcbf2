"""Rows of a safetensors-quantized weight that multiply themselves: `Int8Rows` (w8a8_int8),
`Fp8Rows` (fp8, CUDA) and `Int4Rows` (awq / gptq, CUDA), segments of a `PackedWeight`
(sglite.layers.quant_linear) beside the GGUF `PackedRows`.

Each holds one checkpoint tensor's rows (the output features) as the checkpoint stores them,
with the TP placement protocol of the packed rows (`shape`, `narrow`, `take_rows`, `split`)
and `matmul(x) -> x W^T` (float32 `[n, rows]`, or x's dtype on CUDA) and `dequantize()`
(float32, the reference). On CUDA `Fp8Rows` and `Int4Rows` call the Triton kernels of
`sglite_kernels.quant_gemm` (imported at the first call); on CPU an fp8 checkpoint is
dequantized at load and an int4 one repacked into GGUF blocks (sglite.layers.quant_int4), so
neither reaches these classes there.

`Int8Rows.matmul`: the activations rounded to int8 per token (`absmax / 127` a row, as SGLang's
w8a8_int8), int8 x int8 -> int32 by `torch._int_mm`, then scaled per token and per output
channel. On the CPU `_int_mm` runs 6-20x faster than float32 `F.linear` on the same shapes
(measured on this machine's torch 2.15, 2048x2048, 1 to 256 rows; `benches/bench_quant_safetensors.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from sglite.layers import quant_int4


def _narrow_check(shape: tuple[int, int], dim: int, start: int, length: int, what: str) -> None:
    if dim not in (0, 1) or not 0 <= start <= start + length <= shape[dim]:
        raise ValueError(
            f"{what} {shape}: no {['rows', 'columns'][dim == 1]} {start}:{start + length}"
        )


def _split(rows, sizes: list[int]) -> list:
    if sum(sizes) != rows.shape[0]:
        raise ValueError(f"cannot split {rows.shape[0]} rows into {list(sizes)}")
    out, start = [], 0
    for size in sizes:
        out.append(rows.narrow(0, start, size))
        start += size
    return out


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 `[n, k]`, float32 scales `[n, 1]`): `x ~ q * scale`, scale = absmax / 127 a row."""
    x = x.to(torch.float32)
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / 127.0
    return torch.round(x / scale).clamp_(-127, 127).to(torch.int8), scale


@functools.cache
def _int_mm_on(device_type: str) -> bool:
    """Whether `torch._int_mm` runs here (CPU: torch >= 2.4 builds)."""
    try:
        a = torch.ones((32, 32), dtype=torch.int8, device=device_type)
        return bool(torch._int_mm(a, a.T).eq(32).all())
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def int8_gemm(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """int32 `xq @ wq^T` for int8 `xq [n, k]`, `wq [m, k]`."""
    n = xq.shape[0]
    if _int_mm_on(xq.device.type):
        if xq.device.type == "cuda" and n <= 16:  # cuBLAS int8 wants more than 16 rows
            pad = torch.zeros((17 - n, xq.shape[1]), dtype=torch.int8, device=xq.device)
            return torch._int_mm(torch.cat([xq, pad]), wq.T)[:n]
        return torch._int_mm(xq, wq.T)
    # exact in float64 (sums of k products below 2^14 each)
    return (xq.to(torch.float64) @ wq.to(torch.float64).T).to(torch.int32)


class _WeightRows:
    """The rows interface (`quant_linear.PackedWeight`'s segments) of a class holding its
    `[rows, in]` weight tensor as `weight`."""

    weight: torch.Tensor

    @property
    def data(self) -> torch.Tensor:
        return self.weight

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def dim(self) -> int:
        return 2


@dataclass(frozen=True)
class Int8Rows(_WeightRows):
    """w8a8_int8: `weight` int8 `[rows, in]`, `scale` float32 `[rows]` (per output channel)."""

    weight: torch.Tensor
    scale: torch.Tensor
    qtype: str = "w8a8_int8"

    def __post_init__(self) -> None:
        w, s = self.weight, self.scale
        if w.dtype != torch.int8 or w.dim() != 2:
            raise ValueError(f"w8a8_int8 weight must be 2-D int8, got {w.dtype} {tuple(w.shape)}")
        if s.shape != (w.shape[0],):
            raise ValueError(
                f"w8a8_int8 weight_scale must hold one scale per output row ({w.shape[0]}), got "
                f"{tuple(s.shape)}"
            )

    def narrow(self, dim: int, start: int, length: int) -> Int8Rows:
        _narrow_check(self.shape, dim, start, length, "w8a8_int8 weight")
        scale = self.scale.narrow(0, start, length) if dim == 0 else self.scale
        return Int8Rows(self.weight.narrow(dim, start, length), scale)

    def take_rows(self, index: torch.Tensor) -> Int8Rows:
        return Int8Rows(self.weight.index_select(0, index), self.scale.index_select(0, index))

    def split(self, sizes: list[int]) -> list[Int8Rows]:
        return _split(self, sizes)

    @staticmethod
    def concat(parts: list[Int8Rows]) -> Int8Rows:
        """One segment of consecutive ones (a QKV layer's q, k, v): one rounding, one GEMM."""
        return Int8Rows(
            torch.cat([p.weight for p in parts]).contiguous(), torch.cat([p.scale for p in parts])
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale = quantize_per_token(x)
        acc = int8_gemm(xq, self.weight)
        return acc.to(torch.float32) * x_scale * self.scale

    def dequantize(self) -> torch.Tensor:
        return self.weight.to(torch.float32) * self.scale.unsqueeze(1)


def fp8_dequantize(
    weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int] | None
) -> torch.Tensor:
    """float32 `weight * scale`: scale per tensor (0-d / [1]), per row ([rows] / [rows, 1]) or,
    with `block_size` (bn, bk), one per block `[ceil(rows/bn), ceil(in/bk)]`."""
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if block_size is not None:
        bn, bk = block_size
        s = s.repeat_interleave(bn, 0)[: w.shape[0]].repeat_interleave(bk, 1)[:, : w.shape[1]]
        return w * s
    if s.numel() == 1:
        return w * s.reshape(())
    return w * s.reshape(-1, 1)


@dataclass(frozen=True)
class Fp8Rows(_WeightRows):
    """fp8: `weight` float8_e4m3fn `[rows, in]` and its scale (see `fp8_dequantize`)."""

    weight: torch.Tensor
    scale: torch.Tensor
    block_size: tuple[int, int] | None = None
    qtype: str = "fp8"

    def narrow(self, dim: int, start: int, length: int) -> Fp8Rows:
        _narrow_check(self.shape, dim, start, length, "fp8 weight")
        scale = self.scale
        if self.block_size is not None:
            b = self.block_size[dim]
            if start % b or (length % b and start + length != self.shape[dim]):
                raise ValueError(
                    f"fp8 weight {self.shape}: {['rows', 'columns'][dim]} {start}:{start + length}"
                    f" split its {self.block_size} scale blocks (a tensor-parallel shard or a "
                    f"fused tensor's part must be whole blocks of {b})"
                )
            scale = scale.narrow(dim, start // b, -(-length // b))
        elif dim == 0 and scale.numel() > 1:
            scale = scale.reshape(-1).narrow(0, start, length)
        return Fp8Rows(self.weight.narrow(dim, start, length), scale, self.block_size)

    def take_rows(self, index: torch.Tensor) -> Fp8Rows:
        if self.block_size is not None:
            raise ValueError("fp8 block-scaled weights cannot permute their rows")
        scale = self.scale if self.scale.numel() == 1 else self.scale.reshape(-1)[index]
        return Fp8Rows(self.weight.index_select(0, index), scale)

    def split(self, sizes: list[int]) -> list[Fp8Rows]:
        return _split(self, sizes)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        from sglite_kernels.quant_gemm import fp8_linear

        return fp8_linear(x, self.weight, self.scale, block_size=self.block_size)

    def dequantize(self) -> torch.Tensor:
        return fp8_dequantize(self.weight, self.scale, self.block_size)


@dataclass(frozen=True)
class Int4Rows:
    """awq / gptq (CUDA): the checkpoint's `qweight`, `scales`, `qzeros` (None: symmetric 8)
    and `g_idx` (gptq; None: contiguous groups) for rows `[out, in]`, as `int4_linear` takes
    them: GPTQ's qzeros in the v1 storage (`zero - 1`; a gptq_v2 checkpoint's are shifted to it
    at load)."""

    layout: str
    qweight: torch.Tensor
    scales: torch.Tensor
    qzeros: torch.Tensor | None
    group_size: int
    g_idx: torch.Tensor | None = None

    @property
    def qtype(self) -> str:
        return self.layout

    @property
    def data(self) -> torch.Tensor:
        return self.qweight

    @property
    def shape(self) -> tuple[int, int]:
        out = self.scales.shape[1]
        packed_in = self.qweight.shape[0]
        return (out, packed_in if self.layout == "awq" else packed_in * 8)

    @property
    def num_rows(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> Int4Rows:
        _narrow_check(self.shape, dim, start, length, f"{self.layout} weight")
        awq = self.layout == "awq"
        if dim == 0:  # output features: AWQ packs them by 8 (qweight), both pack qzeros by 8
            if start % 8 or length % 8:
                raise ValueError(
                    f"{self.layout} weight: rows {start}:{start + length} are not whole packed "
                    "words of 8 outputs"
                )
            qw = self.qweight.narrow(1, start // 8, length // 8) if awq else self.qweight
            if not awq:
                qw = qw.narrow(1, start, length)
            qz = None if self.qzeros is None else self.qzeros.narrow(1, start // 8, length // 8)
            return Int4Rows(
                self.layout,
                qw,
                self.scales.narrow(1, start, length),
                qz,
                self.group_size,
                self.g_idx,
            )
        if start == 0 and length == self.in_features:
            return self
        if self.g_idx is not None:  # scales stay whole; g_idx names each column's group
            if start % 8 or length % 8:
                raise ValueError(
                    f"gptq weight: columns {start}:{start + length} split a packed word"
                )
            return Int4Rows(
                self.layout, self.qweight.narrow(0, start // 8, length // 8), self.scales,
                self.qzeros, self.group_size, self.g_idx.narrow(0, start, length),
            )  # fmt: skip
        g = self.group_size
        if start % g or length % g:
            raise ValueError(
                f"{self.layout} weight: columns {start}:{start + length} split its groups of {g} "
                "(row-parallel layers need in_features / tp_size to be a multiple of group_size)"
            )
        qw = (
            self.qweight.narrow(0, start, length)
            if awq
            else self.qweight.narrow(0, start // 8, length // 8)
        )
        qz = None if self.qzeros is None else self.qzeros.narrow(0, start // g, length // g)
        return Int4Rows(self.layout, qw, self.scales.narrow(0, start // g, length // g), qz, g)

    def take_rows(self, index: torch.Tensor) -> Int4Rows:
        raise ValueError(
            f"{self.layout} weights cannot permute their output rows (this model's rotary layout "
            "needs it); serve this family from a float checkpoint"
        )

    def split(self, sizes: list[int]) -> list[Int4Rows]:
        return _split(self, sizes)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        from sglite_kernels.quant_gemm import int4_linear

        return int4_linear(
            x,
            self.qweight,
            self.scales,
            self.qzeros,
            self.group_size,
            self.layout,
            g_idx=self.g_idx,
        )

    def dequantize(self) -> torch.Tensor:
        offset = 1 if self.layout == "gptq" and self.qzeros is not None else 0
        levels, zeros, scales = quant_int4.unpack(
            self.layout, self.qweight, self.qzeros, self.scales, zero_offset=offset
        )
        g_idx = self.g_idx
        if g_idx is None:
            g_idx = quant_int4.default_g_idx(self.in_features, self.group_size, levels.device)
        return quant_int4.dequantize(levels, zeros, scales, g_idx)
