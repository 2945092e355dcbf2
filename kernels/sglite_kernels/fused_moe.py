"""Fused MoE: routed experts as two grouped GEMMs over tokens aligned by expert.

Inputs: `x [T, H]`, the router's `topk_ids [T, K]` (global expert ids) and `topk_weights
[T, K]`, this rank's stacked experts `w13 [E, 2I, H]` (gate rows, then up rows) and
`w2 [E, H, I]`, optional biases `b13 [E, 2I]`, `b2 [E, H]`; local expert e is global id
`expert_start + e`, pairs routed to other ids add nothing. Output `[T, H]` in x's dtype:
`sum_k w[t, k] * (act(x_t W_g^T + b_g) * (x_t W_u^T + b_u)) W_d^T + b_d` over the local
experts of token t.

1. `moe_align` (moe_align.py) sorts the (token, slot) pairs by expert into BLOCK_M tiles.
2. `_gate_up_kernel`, one program per (tile, BLOCK_N columns of I): the tile's token rows
   of x times its expert's gate and up rows (two fp32 accumulators over the same A tile),
   bias, then the gated activation in the epilogue; it stores `act(g) * u` at the rows of
   its pairs in `h [T*K, I]`.
3. `_down_kernel`, one program per (tile, BLOCK_N columns of H): h's rows times the
   expert's down rows, bias, times the pair's routing weight (fp32), stored at the pair's
   row of `y [T*K, H]` (zeros for pairs of other ranks' experts); then `y` summed over
   each token's K slots in fp32.

Every matmul accumulates in fp32; h and y are rounded to x's dtype. No host sync: the grid
is an upper bound from the shapes and surplus tiles exit at once (see moe_align).

Activations (`act`, gated): silu, gelu (erf), gelu_tanh, relu, quick_gelu, relu2, and
gpt-oss's clamped_swiglu `(clamp(u, -l, l) + 1) * g * sigmoid(alpha * g)`, `g = min(g, l)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    check_float,
    check_same_device,
    check_same_dtype,
    dot_in_fp32,
    dot_precision,
    interpreted,
    tile_dot,
)
from .moe_align import moe_align

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "quick_gelu", "relu2", "clamped_swiglu")


@triton.jit
def _tanh(x):
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _gated(g, u, alpha, limit, ACT: tl.constexpr):
    """act(g) * u of fp32 tiles; ACT indexes ACTIVATIONS."""
    if ACT == 0:
        a = g * tl.sigmoid(g)
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    elif ACT == 2:
        a = 0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    elif ACT == 3:
        a = tl.maximum(g, 0.0)
    elif ACT == 4:
        a = g * tl.sigmoid(1.702 * g)
    elif ACT == 5:
        r = tl.maximum(g, 0.0)
        a = r * r
    else:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit) + 1.0
        a = g * tl.sigmoid(alpha * g)
    return a * u


@triton.jit
def _gate_up_kernel(
    X,
    W,
    B,
    Out,
    SortedIds,
    BlockExpert,
    num_pairs,
    top_k,
    inter,
    hidden,
    stride_xt,
    stride_we,
    stride_wn,
    stride_be,
    stride_ot,
    alpha,
    limit,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    e = tl.load(BlockExpert + pid_m)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds + offs_m)
    valid = pair < num_pairs
    token = (pair // top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptr = X + token[:, None] * stride_xt + offs_k[None, :]
    # the weight tiles are read transposed: [BLOCK_K, BLOCK_N] of W[e, n, k]
    g_ptr = W + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptr = g_ptr + inter * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        mask_k = offs_k < hidden - k0
        a = tl.load(x_ptr, mask=valid[:, None] & mask_k[None, :], other=0.0)
        w_mask = mask_k[:, None] & mask_n[None, :]
        acc_g += tile_dot(a, tl.load(g_ptr, mask=w_mask, other=0.0), DOT_FP32, PRECISION)
        acc_u += tile_dot(a, tl.load(u_ptr, mask=w_mask, other=0.0), DOT_FP32, PRECISION)
        x_ptr += BLOCK_K
        g_ptr += BLOCK_K
        u_ptr += BLOCK_K
    if HAS_BIAS:
        b_ptr = B + e.to(tl.int64) * stride_be + offs_n
        acc_g += tl.load(b_ptr, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + inter, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    h = _gated(acc_g, acc_u, alpha, limit, ACT)
    out_ptr = Out + pair.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptr, h.to(Out.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(
    Hid,
    W,
    B,
    TopkW,
    Out,
    SortedIds,
    BlockExpert,
    num_pairs,
    hidden,
    inter,
    stride_ht,
    stride_we,
    stride_wn,
    stride_be,
    stride_ot,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    e = tl.load(BlockExpert + pid_m)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds + offs_m)
    valid = pair < num_pairs
    row = pair.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    h_ptr = Hid + row[:, None] * stride_ht + offs_k[None, :]
    w_ptr = W + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        mask_k = offs_k < inter - k0
        a = tl.load(h_ptr, mask=valid[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptr, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc += tile_dot(a, w, DOT_FP32, PRECISION)
        h_ptr += BLOCK_K
        w_ptr += BLOCK_K
    if HAS_BIAS:
        b = tl.load(B + e.to(tl.int64) * stride_be + offs_n, mask=mask_n, other=0.0)
        acc += b.to(tl.float32)[None, :]
    weight = tl.load(TopkW + row, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out_ptr = Out + row[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptr, acc.to(Out.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


def moe_tiles(num_pairs: int, num_local: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): BLOCK_M follows the mean rows per expert, so
    that decode batches (a few rows per expert) waste little of each tile."""
    if interpreted():
        return 16, 32, 32, 4
    per_expert = num_pairs / num_local
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    block_k = 32 if dtype == torch.float32 else 64
    if block_m == 64:
        return 64, 128, block_k, 8
    return block_m, 64, block_k, 4


def _check(x, topk_ids, topk_weights, w13, w2, b13, b2) -> None:
    check_float("x", x, 2)
    check_float("w13", w13, 3)
    check_float("w2", w2, 3)
    check_same_dtype(x=x, w13=w13, w2=w2)
    t, hidden = x.shape
    e, two_i, h13 = w13.shape
    if h13 != hidden or two_i % 2 or two_i == 0:
        raise ValueError(f"w13 must be [E, 2I, {hidden}], got {tuple(w13.shape)}")
    if tuple(w2.shape) != (e, hidden, two_i // 2):
        raise ValueError(f"w2 must be [{e}, {hidden}, {two_i // 2}], got {tuple(w2.shape)}")
    if (
        topk_ids.dim() != 2
        or topk_ids.shape[0] != t
        or topk_ids.dtype
        not in (
            torch.int32,
            torch.int64,
        )
    ):
        raise ValueError(
            f"topk_ids must be [{t}, K] int32/int64, got {topk_ids.dtype} {tuple(topk_ids.shape)}"
        )
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
        raise ValueError(
            f"topk_weights must be float {tuple(topk_ids.shape)} like topk_ids, got "
            f"{topk_weights.dtype} {tuple(topk_weights.shape)}"
        )
    for name, b, shape in (("b13", b13, (e, two_i)), ("b2", b2, (e, hidden))):
        if b is not None and (tuple(b.shape) != shape or b.stride(-1) != 1):
            raise ValueError(f"{name} must be {shape} with a contiguous last dim")
    tensors = dict(x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w2=w2)
    tensors.update({n: b for n, b in (("b13", b13), ("b2", b2)) if b is not None})
    check_same_device(**tensors)


def fused_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    expert_start: int = 0,
    act: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    tiles: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """The local experts' weighted sum for each token of `x [T, H]` (see the module doc).
    `tiles` = (BLOCK_M, BLOCK_N, BLOCK_K) overrides `moe_tiles` (powers of two, >= 16)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"act={act!r} is not one of {ACTIVATIONS}")
    _check(x, topk_ids, topk_weights, w13, w2, b13, b2)
    t, hidden = x.shape
    num_local, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_pairs = t * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m, block_n, block_k, warps = moe_tiles(num_pairs, num_local, x.dtype)
    if tiles is not None:
        block_m, block_n, block_k = tiles
    align = moe_align(topk_ids, expert_start, num_local, block_m)
    weights = topk_weights.reshape(-1).contiguous()
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.zeros(num_pairs, hidden, dtype=x.dtype, device=x.device)
    dot = dict(DOT_FP32=dot_in_fp32(x), PRECISION=dot_precision(x.dtype))
    launch = dict(num_warps=warps) if interpreted() else dict(num_warps=warps, num_stages=3)
    _gate_up_kernel[(align.num_blocks, triton.cdiv(inter, block_n))](
        x,
        w13,
        b13 if b13 is not None else w13,
        h,
        align.sorted_ids,
        align.block_expert,
        num_pairs,
        top_k,
        inter,
        hidden,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        b13.stride(0) if b13 is not None else 0,
        h.stride(0),
        float(swiglu_alpha),
        float(swiglu_limit),
        ACT=ACTIVATIONS.index(act),
        HAS_BIAS=b13 is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        **dot,
        **launch,
    )
    _down_kernel[(align.num_blocks, triton.cdiv(hidden, block_n))](
        h,
        w2,
        b2 if b2 is not None else w2,
        weights,
        y,
        align.sorted_ids,
        align.block_expert,
        num_pairs,
        hidden,
        inter,
        h.stride(0),
        w2.stride(0),
        w2.stride(1),
        b2.stride(0) if b2 is not None else 0,
        y.stride(0),
        HAS_BIAS=b2 is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        **dot,
        **launch,
    )
    if top_k == 1:
        return y
    return y.view(t, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
