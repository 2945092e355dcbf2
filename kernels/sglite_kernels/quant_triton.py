"""The Triton kernels of quant_gemm (FP8 and AWQ/GPTQ int4 weight-only GEMMs) and their tiles.

One program computes a [BLOCK_M, BLOCK_N] tile of y over its share of K (`k_per_split`
columns; with SPLIT the fp32 partials of the K splits are added atomically into a zeroed
fp32 y). Pointers: x [M, K] row-major (stride_xm), y [M, N] (stride_om); weights as their
checkpoints store them (see quant_ref). Masks cover ragged M, N and K edges.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import interpreted
from ._common import tile_dot as _tile_dot


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _epilogue(acc, B, Out, offs_m, offs_n, mask_m, mask_n, stride_om, pid_k, HAS_BIAS, SPLIT):
    if HAS_BIAS:  # added by the first K split only
        b = tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc += tl.where(pid_k == 0, b, 0.0)[None, :]
    out = Out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")  # the sum's order is free
    else:
        tl.store(out, acc.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_kernel(
    X, XS, W, S, B, Out, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    k_per_split, scale_bn, scale_bk,
    SCALE: tl.constexpr, X_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """X_FP8: x is fp8 with a scale per row in XS (w8a8; the dot multiplies fp8 operands)."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_ptr = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    # the weight tile is read transposed: [BLOCK_K, BLOCK_N] of weight[n, k]
    w_ptr = W + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    s_ptr = S + (offs_n // scale_bn).to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        mask_k = offs_k < k_end
        a = tl.load(x_ptr, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # weight-only: fp8 -> x's dtype (exact); w8a8: a is fp8 too and this is a no-op
        w = tl.load(w_ptr, mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(a.dtype)
        part = _tile_dot(a, w, DOT_FP32, PRECISION)
        if SCALE == 2:  # one (bn x bk) block per column in this K tile (BLOCK_K divides bk)
            s = tl.load(s_ptr + k0 // scale_bk, mask=mask_n, other=0.0)
            acc += part * s.to(tl.float32)[None, :]
        else:
            acc += part
        offs_k += BLOCK_K
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K
    if SCALE == 0:
        acc = acc * tl.load(S).to(tl.float32)
    elif SCALE == 1:
        acc = acc * tl.load(S + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if X_FP8:
        acc = acc * tl.load(XS + offs_m, mask=mask_m, other=0.0)[:, None]
    _epilogue(acc, B, Out, offs_m, offs_n, mask_m, mask_n, stride_om, pid_k, HAS_BIAS, SPLIT)


@triton.jit
def _int4_kernel(
    X, QW, S, QZ, G, B, Out, M, N, K,
    stride_xm, stride_qw, stride_s, stride_qz, stride_om,
    group_size, k_per_split,
    GPTQ: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
    ROW_GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_ptr = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    col = offs_n % 8
    # nibble of column 8j + c: sequential for GPTQ, AWQ's interleave (c // 2) + 4 (c % 2)
    if GPTQ:
        z_shift = 4 * col
    else:
        z_shift = 4 * (col // 2 + 4 * (col % 2))
    packed_n = (offs_n // 8).to(tl.int64)
    nib = tl.arange(0, 8)
    words = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        mask_k = offs_k < k_end
        mask_w = mask_k[:, None] & mask_n[None, :]
        a = tl.load(x_ptr, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # each packed int32 is loaded once and expanded in registers to its 8 nibbles
        if GPTQ:  # [BLOCK_K / 8, BLOCK_N] words, nibble i = row 8r + i
            rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            qw_ptr = QW + rows.to(tl.int64)[:, None] * stride_qw + offs_n[None, :]
            p = tl.load(qw_ptr, mask=(rows * 8 < k_end)[:, None] & mask_n[None, :], other=0)
            q = (p[:, None, :] >> (4 * nib)[None, :, None]) & 0xF
        else:  # [BLOCK_K, BLOCK_N / 8] words, column 8j + c in nibble AWQ_NIBBLE[c]
            qw_ptr = QW + offs_k.to(tl.int64)[:, None] * stride_qw + words[None, :]
            p = tl.load(qw_ptr, mask=mask_k[:, None] & (words * 8 < N)[None, :], other=0)
            q = (p[:, :, None] >> (4 * (nib // 2 + 4 * (nib % 2)))[None, None, :]) & 0xF
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))
        if ROW_GROUPS:  # the group varies along k: scale each element, then one dot
            if HAS_GIDX:
                g = tl.load(G + offs_k, mask=mask_k, other=0).to(tl.int64)
            else:
                g = (offs_k // group_size).to(tl.int64)
            s = tl.load(S + g[:, None] * stride_s + offs_n[None, :], mask=mask_w, other=0.0)
            if HAS_ZEROS:
                zp = tl.load(QZ + g[:, None] * stride_qz + packed_n[None, :], mask=mask_w, other=0)
                z = (zp >> z_shift[None, :]) & 0xF
                if GPTQ:
                    z += 1
            else:
                z = 8
            w = ((q - z).to(tl.float32) * s.to(tl.float32)).to(a.dtype)
            acc += _tile_dot(a, w, DOT_FP32, PRECISION)
        else:  # one group for the whole K tile: the exact integers q - z, scaled after
            g = k0 // group_size
            s = tl.load(S + g * stride_s + offs_n, mask=mask_n, other=0.0)
            if HAS_ZEROS:
                zp = tl.load(QZ + g * stride_qz + packed_n, mask=mask_n, other=0)
                z = (zp >> z_shift) & 0xF
                if GPTQ:
                    z += 1
                z = z[None, :]
            else:
                z = 8
            part = _tile_dot(a, (q - z).to(tl.float32).to(a.dtype), DOT_FP32, PRECISION)
            acc += part * s.to(tl.float32)[None, :]
        offs_k += BLOCK_K
        x_ptr += BLOCK_K
    _epilogue(acc, B, Out, offs_m, offs_n, mask_m, mask_n, stride_om, pid_k, HAS_BIAS, SPLIT)


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def gemm_tiles(m: int, n: int, k: int, device: torch.device) -> Tiles:
    """The launch tiles of an [m, k] x [k, n] product on `device` (see tile_table)."""
    if interpreted() or device.type != "cuda":
        return Tiles(16, 32, 32, 1, 4, 1)
    return tile_table(m, n, k, _sm_count(device))


def tile_table(m: int, n: int, k: int, sm_count: int) -> Tiles:
    """Fixed tiles by M (no autotuning: the first call of a shape must not pay a search, and
    CUDA-graph capture must not see one). Decode M <= 64 is weight-bandwidth bound: the
    smallest M tile tl.dot allows, narrow N tiles and wide K tiles (long contiguous reads of
    the packed weight), and K split until about two programs per SM stream the weight.
    Prefill M is compute bound: 64x128 / 128x128 tiles reuse each dequantized weight tile
    across many rows; K is split only if the tiles fill under half the SMs (a near-full
    wave gains less than the fp32 partials cost). A split keeps >= 4 K tiles per program."""
    if m <= 16:
        tiles = Tiles(16, 64, 128, 1, 4, 4)
    elif m <= 64:
        tiles = Tiles(32, 64, 128, 1, 4, 4)
    elif m <= 256:
        tiles = Tiles(64, 128, 64, 1, 4, 4)
    else:
        tiles = Tiles(128, 128, 64, 1, 8, 3)
    programs = triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n)
    target = 2 * sm_count if m <= 64 else sm_count
    if programs < (target if m <= 64 else sm_count // 2):
        split = min(triton.cdiv(target, programs), max(1, k // (4 * tiles.block_k)))
        tiles = tiles._replace(split_k=split)
    return tiles
