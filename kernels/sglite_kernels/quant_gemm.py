"""Quantized linears on CUDA (Triton): FP8 (e4m3) and AWQ / GPTQ int4 weights times x.

`fp8_linear(x, weight, weight_scale, block_size, bias)` = x @ (weight * scale).T + bias and
`int4_linear(x, qweight, scales, qzeros, group_size, layout, g_idx, bias)` = x @ W + bias,
for x [..., in] in fp32 / fp16 / bf16, the result in x's dtype; the weight formats are
described in quant_ref.py (the pure-torch references, re-exported here); the kernels and
the tile table are in quant_triton.py. This module validates and launches.

Weight-only: each program loads a [BLOCK_K, BLOCK_N] tile of the packed weight, expands it
in registers to x's dtype (fp8 -> bf16/fp16 is exact; int4 q - z in [-16, 15] is exact) and
multiplies it with tl.dot, accumulating in fp32. Where a K tile lies in one scale group (per
tensor / channel, FP8 blocks, int4 groups aligned to BLOCK_K) the scale multiplies the tile's
fp32 partial product per column; otherwise (GPTQ act-order g_idx, groups narrower than 16)
each weight element is scaled before the dot. Small M splits K over `split_k` programs that
add fp32 partials atomically, so that a decode GEMV still covers every SM. No host sync.

FP8 also has a w8a8 option (`w8a8=True`, off by default): x quantized per token to e4m3
and fp8 x fp8 tensor-core products (sm_89+), the per-token and weight scales applied to the
fp32 accumulator.
"""

from __future__ import annotations

import torch
import triton

from ._common import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    check_same_device,
    dot_in_fp32,
    dot_precision,
    interpreted,
)
from .quant_ref import (
    LAYOUTS,
    _block,
    fp8_dequantize,
    fp8_quantize_rows,
    fp8_scale_kind,
    int4_dequantize,
)
from .quant_triton import Tiles, _fp8_kernel, _int4_kernel, gemm_tiles, tile_table

__all__ = ["Tiles", "fp8_dequantize", "fp8_linear", "gemm_tiles", "int4_dequantize", "int4_linear"]
__all__ += ["fp8_quantize_rows", "gptq_g_idx_is_trivial", "tile_table"]

_SCALE_KIND = {"tensor": 0, "channel": 1, "block": 2}


def _aligned_block_k(block_k: int, group: int) -> int:
    """The largest power of two <= block_k dividing `group`, or 0 if that is under 16."""
    b = min(block_k, group & -group)
    return b if b >= 16 else 0


def _check_x(x: torch.Tensor, in_features: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a float32 / float16 / bfloat16 tensor, got {got}")
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(f"x must be [..., {in_features}], got {list(x.shape)}")
    x2 = x.reshape(-1, in_features)
    return x2 if x2.stride(-1) == 1 or x2.numel() == 0 else x2.contiguous()


def _check_bias(bias: torch.Tensor | None, n: int) -> None:
    if bias is not None and (
        bias.shape != (n,) or not bias.is_floating_point() or bias.stride(0) != 1
    ):
        raise ValueError(f"bias must be a contiguous float [{n}], got {list(bias.shape)}")


def _check_contig(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t is not None and t.dim() > 0 and t.numel() > 0 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim; call .contiguous()")


def _run(kernel, x2, n, bias, tiles: Tiles, out_shape, args, consts, dtype=None) -> torch.Tensor:
    """Launch `kernel` over y [m, n] of `dtype` (x2's by default)."""
    m, k = x2.shape
    dtype = dtype or x2.dtype
    if any(b < 16 or b & (b - 1) for b in tiles[:3]) or tiles.split_k < 1:
        raise ValueError(f"tiles must be powers of two >= 16 and split_k >= 1, got {tiles}")
    split = tiles.split_k > 1
    out = torch.zeros if split else torch.empty
    y = out(m, n, dtype=torch.float32 if split else dtype, device=x2.device)
    k_per_split = triton.cdiv(triton.cdiv(k, tiles.split_k), tiles.block_k) * tiles.block_k
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(m, tiles.block_m), tiles.split_k)
    launch = {} if interpreted() else dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    kernel[grid](
        *args(y, k_per_split),
        HAS_BIAS=bias is not None,
        SPLIT=split,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        # the interpreter multiplies raw fp8 / bf16 bits: widen the tiles there
        DOT_FP32=dot_in_fp32(x2) or (x2.device.type == "cpu" and x2.dtype in FP8_DTYPES),
        PRECISION=dot_precision(x2.dtype),
        **consts,
        **launch,
    )
    return y.to(dtype).reshape(out_shape) if split else y.reshape(out_shape)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_size=None,
    bias: torch.Tensor | None = None,
    *,
    w8a8: bool = False,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """x @ (weight * weight_scale).T + bias in x's dtype (fp32 accumulation). weight:
    float8_e4m3fn [out, in]; weight_scale: per tensor, per channel, or per block with
    block_size (bn, bk), bk a multiple of 16 (see quant_ref). `tiles` overrides gemm_tiles.

    w8a8=False (default): weight-only, x multiplied as given. w8a8=True: x is quantized per
    token to fp8 (fp8_quantize_rows, in torch) and tl.dot multiplies fp8 by fp8 (sm_89+):
    faster where compute bound (prefill), at the cost of x's rounding to 3 mantissa bits."""
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be float8_e4m3fn, got {getattr(weight, 'dtype', weight)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [out, in], got {list(weight.shape)}")
    if not isinstance(weight_scale, torch.Tensor) or not weight_scale.is_floating_point():
        raise ValueError("weight_scale must be a float tensor")
    n, k = weight.shape
    kind = fp8_scale_kind((n, k), weight_scale, block_size)
    x2 = _check_x(x, k)
    _check_bias(bias, n)
    _check_contig(weight=weight, weight_scale=weight_scale)
    tensors = dict(x=x2, weight=weight, weight_scale=weight_scale)
    check_same_device(**tensors, **({} if bias is None else dict(bias=bias)))
    out_shape = (*x.shape[:-1], n)
    if x2.shape[0] == 0:
        return x.new_empty(out_shape)
    if w8a8 and x2.is_cuda and torch.cuda.get_device_capability(x2.device) < (8, 9):
        raise ValueError("w8a8 needs fp8 tensor cores (sm_89+); use the weight-only default")
    tiles = tiles or gemm_tiles(x2.shape[0], n, k, x2.device)
    scale = weight_scale.reshape(-1) if kind != "block" else weight_scale
    bn, bk = _block(block_size) if kind == "block" else (1, 1)
    if kind == "block":
        block_k = _aligned_block_k(tiles.block_k, bk)
        if not block_k:
            raise ValueError(f"block_size's bk must be a multiple of 16, got {bk}")
        tiles = tiles._replace(block_k=block_k)
    stride_sn = scale.stride(0) if kind == "block" else 0

    xq, x_scale = fp8_quantize_rows(x2) if w8a8 else (x2, scale)

    def args(y, k_per_split):
        return (xq, x_scale, weight, scale, bias if bias is not None else scale, y, x2.shape[0],
                n, k, xq.stride(0), weight.stride(0), stride_sn, y.stride(0), k_per_split, bn, bk)  # fmt: skip

    consts = dict(SCALE=_SCALE_KIND[kind], X_FP8=w8a8)
    return _run(_fp8_kernel, xq, n, bias, tiles, out_shape, args, consts, dtype=x2.dtype)


def _check_int4(x, qweight, scales, qzeros, group_size, layout, g_idx) -> tuple[int, int, int]:
    """(in, out, group size) after checking every tensor against the layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError("qweight must be a 2-D int32 tensor")
    rows, cols = qweight.shape
    k, n = (rows, cols * 8) if layout == "awq" else (rows * 8, cols)
    want = "[in, out/8]" if layout == "awq" else "[in/8, out]"
    if x.shape[-1] != k:
        raise ValueError(f"x's last dim {x.shape[-1]} != in {k} of {layout} qweight {want}")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an int, got {group_size!r}")
    gs = k if group_size == -1 else group_size
    if gs < 1:
        raise ValueError(f"group_size must be -1 or positive, got {group_size}")
    if g_idx is not None:
        if layout != "gptq":
            raise ValueError("g_idx is a GPTQ field; AWQ groups are always k // group_size")
        if g_idx.shape != (k,) or g_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"g_idx must be int32/int64 [{k}], got {g_idx.dtype} {list(g_idx.shape)}"
            )
        groups = scales.shape[0] if scales.dim() == 2 else -1
    else:
        if k % gs:
            raise ValueError(f"in ({k}) must be a multiple of group_size ({group_size})")
        groups = k // gs
    if not scales.is_floating_point() or scales.dim() != 2 or tuple(scales.shape) != (groups, n):
        raise ValueError(
            f"scales must be float [{groups}, {n}], got {scales.dtype} {list(scales.shape)}"
        )
    if qzeros is not None and (
        qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (groups, n // 8)
    ):
        raise ValueError(
            f"qzeros must be int32 [{groups}, {n // 8}], got {qzeros.dtype} {list(qzeros.shape)}"
        )
    return k, n, gs


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    group_size: int,
    layout: str,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """x @ W + bias in x's dtype (fp32 accumulation), W the AWQ or GPTQ int4 weight [in, out]
    (see quant_ref). Pass g_idx only when it is not k // group_size (act-order checkpoints;
    gptq_g_idx_is_trivial tells): a given g_idx scales every weight element. Its values must
    lie in [0, groups): not checked here, as that would read the device. `tiles` overrides
    gemm_tiles."""
    k, n, gs = _check_int4(x, qweight, scales, qzeros, group_size, layout, g_idx)
    x2 = _check_x(x, k)
    _check_bias(bias, n)
    _check_contig(qweight=qweight, scales=scales, qzeros=qzeros)
    named = dict(x=x2, qweight=qweight, scales=scales, qzeros=qzeros, g_idx=g_idx, bias=bias)
    check_same_device(**{name: t for name, t in named.items() if t is not None})
    out_shape = (*x.shape[:-1], n)
    if x2.shape[0] == 0:
        return x.new_empty(out_shape)
    tiles = tiles or gemm_tiles(x2.shape[0], n, k, x2.device)
    row_groups = g_idx is not None
    if not row_groups and gs < k:
        block_k = _aligned_block_k(tiles.block_k, gs)
        row_groups = block_k == 0
        tiles = tiles._replace(block_k=block_k or tiles.block_k)
    gidx = g_idx.contiguous() if g_idx is not None else qweight
    zeros = qzeros if qzeros is not None else qweight

    def args(y, k_per_split):
        return (x2, qweight, scales, zeros, gidx, bias if bias is not None else scales, y,
                x2.shape[0], n, k, x2.stride(0), qweight.stride(0), scales.stride(0),
                zeros.stride(0), y.stride(0), gs, k_per_split)  # fmt: skip

    consts = dict(
        GPTQ=layout == "gptq",
        HAS_ZEROS=qzeros is not None,
        HAS_GIDX=g_idx is not None,
        ROW_GROUPS=row_groups,
    )
    return _run(_int4_kernel, x2, n, bias, tiles, out_shape, args, consts)


def gptq_g_idx_is_trivial(g_idx: torch.Tensor, group_size: int) -> bool:
    """Whether g_idx is k // group_size (then int4_linear should get g_idx=None): a loader's
    check, once per weight (it reads the tensor)."""
    k = g_idx.shape[0]
    gs = k if group_size == -1 else group_size
    want = torch.arange(k, device=g_idx.device) // max(gs, 1)
    return bool(torch.equal(g_idx.to(torch.int64), want))
