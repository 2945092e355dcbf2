"""MLA decode attention (absorbed form) over the latent KV pool, split-KV.

The pool ``kv_buffer`` [num_slots, 1, Dc + Dr] holds one row per token: the latent (its
first Dc dims, which are also the value) and the rope key (the last Dr). Query b, head h is
``q[b, h]`` = [q_latent (Dc) | q_rope (Dr)]; its score against slot s is q . kv_buffer[s]
and its output (``o[b, h]``, Dc dims) the softmax-weighted sum of the latents. So it is MQA
with one KV head and a value dim smaller than the key dim, and each latent tile is loaded
once for both the scores and the values. Slots are addressed CSR-style as in
decode_attention (``kv_indptr`` [B+1], ``kv_indices``).

Stage 1, grid (B, cdiv(Hq, BLOCK_H), max_splits): program (b, g, s) takes split s of request
b's tokens for BLOCK_H query heads; it runs an online softmax (base 2) and stores the split's
normalised output and log2-sum-exp in ``mid_o`` [B, Hq, max_splits, Dc] / ``mid_lse``.
Stage 2 is decode_attention's merge (over Dc). Dc must be a power of two (16..512); Dr any
width up to 256 (padded to a power of two with masked loads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    check_float,
    check_head_dim,
    check_index,
    check_same_device,
    check_same_dtype,
    dot_in_fp32,
    dot_precision,
    next_pow2,
    tile_dot,
)
from .decode_attention import _decode_stage2

_LOG2E = 1.4426950408889634


@triton.jit
def _mla_stage1(
    Q,
    KV,
    KvIndptr,
    KvIndices,
    NumSplits,
    MidO,
    MidLse,
    sm_scale_log2,
    num_heads,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    n_splits = tl.minimum(tl.maximum(tl.load(NumSplits + b), 1), MAX_SPLITS)
    if s < n_splits:
        kv_start = tl.load(KvIndptr + b).to(tl.int64)
        kv_len = (tl.load(KvIndptr + b + 1) - kv_start).to(tl.int32)
        split_len = tl.cdiv(tl.cdiv(kv_len, n_splits), BLOCK_N) * BLOCK_N
        lo = s * split_len
        hi = tl.minimum(lo + split_len, kv_len)

        heads = g * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = heads < num_heads
        offs_c = tl.arange(0, LATENT)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < ROPE
        q_row = Q + b * stride_qb + heads[:, None] * stride_qh
        q_c = tl.load(q_row + offs_c[None, :], mask=mask_h[:, None], other=0.0)
        q_r = tl.load(
            q_row + LATENT + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0
        )
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, LATENT], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            slot = tl.load(KvIndices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            row = KV + slot[:, None] * stride_kt
            c = tl.load(row + offs_c[None, :], mask=mask_n[:, None], other=0.0)
            r = tl.load(
                row + LATENT + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0
            )
            qk = tile_dot(q_c, tl.trans(c), DOT_FP32, PRECISION)
            qk += tile_dot(q_r, tl.trans(r), DOT_FP32, PRECISION)
            qk = tl.where(mask_n[None, :], qk * sm_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tile_dot(p.to(c.dtype), c, DOT_FP32, PRECISION)
            m_i = m_new

        has_any = l_i > 0
        out = acc / tl.where(has_any, l_i, 1.0)[:, None]
        lse = tl.where(has_any, m_i + tl.log2(tl.where(has_any, l_i, 1.0)), float("-inf"))
        tl.store(
            MidO + b * stride_mob + heads[:, None] * stride_moh + s * stride_mos + offs_c[None, :],
            out,
            mask=mask_h[:, None],
        )
        tl.store(MidLse + b * stride_mlb + heads * stride_mlh + s, lse, mask=mask_h)


def mla_decode_attention(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_kv_splits: torch.Tensor,
    max_splits: int,
    sm_scale: float,
    mid_o: torch.Tensor | None = None,
    mid_lse: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
) -> torch.Tensor:
    """o[b, h] = softmax(q[b, h] . KV_b^T * sm_scale) KV_b[:, :Dc] over request b's slots.

    q: [B, Hq, Dc + Dr]; kv_buffer: [num_slots, 1, Dc + Dr] (its rows' first Dc dims are the
    values); o: [B, Hq, Dc]; kv_indptr [B+1], kv_indices, num_kv_splits [B] as in
    decode_attention; mid_o [B, Hq, max_splits, Dc] / mid_lse [B, Hq, max_splits] (fp32) are
    optional scratch. Returns o.
    """
    check_float("q", q, 3)
    check_float("kv_buffer", kv_buffer, 3)
    check_float("o", o, 3)
    check_same_dtype(q=q, kv_buffer=kv_buffer, o=o)
    batch, num_heads, dk = q.shape
    latent = o.shape[2]
    rope = dk - latent
    check_index("kv_indptr", kv_indptr, batch + 1)
    check_index("kv_indices", kv_indices)
    check_index("num_kv_splits", num_kv_splits, batch)
    check_same_device(
        q=q, kv_buffer=kv_buffer, o=o, kv_indptr=kv_indptr, kv_indices=kv_indices,
        num_kv_splits=num_kv_splits,
    )  # fmt: skip
    if o.shape[:2] != q.shape[:2] or not 0 < rope <= 256:
        raise ValueError(
            f"o must be [B, Hq, Dc] under q [B, Hq, Dc + Dr] with 0 < Dr <= 256, got "
            f"{tuple(o.shape)} and {tuple(q.shape)}"
        )
    if kv_buffer.shape[1:] != (1, dk) or kv_buffer.stride(2) != 1:
        raise ValueError(
            f"kv_buffer must be [num_slots, 1, {dk}] (one latent row per token), got "
            f"{tuple(kv_buffer.shape)}"
        )
    check_head_dim(latent)
    if max_splits < 1:
        raise ValueError(f"max_splits must be >= 1, got {max_splits}")
    mid_shape = (batch, num_heads, max_splits)
    if mid_o is None:
        mid_o = torch.empty((*mid_shape, latent), dtype=torch.float32, device=q.device)
    if mid_lse is None:
        mid_lse = torch.empty(mid_shape, dtype=torch.float32, device=q.device)
    for name, t, shape in (("mid_o", mid_o, (*mid_shape, latent)), ("mid_lse", mid_lse, mid_shape)):
        if t.dtype != torch.float32 or tuple(t.shape[: len(shape)]) != shape:
            raise ValueError(f"{name} must be float32 with leading shape {shape}")
        if t.stride(-1) != 1 or t.device != q.device:
            raise ValueError(f"{name} must be last-dim contiguous on {q.device}")
    if batch == 0:
        return o
    block_h = 16
    block_n = block_n or (32 if latent <= 256 else 16)
    _mla_stage1[(batch, triton.cdiv(num_heads, block_h), max_splits)](
        q,
        kv_buffer,
        kv_indptr,
        kv_indices,
        num_kv_splits,
        mid_o,
        mid_lse,
        sm_scale * _LOG2E,
        num_heads,
        q.stride(0),
        q.stride(1),
        kv_buffer.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        LATENT=latent,
        ROPE=rope,
        BLOCK_R=max(16, next_pow2(rope)),
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        MAX_SPLITS=max_splits,
        PRECISION=dot_precision(q.dtype),
        DOT_FP32=dot_in_fp32(q),
        num_warps=4 if latent <= 128 else 8,
        num_stages=2,
    )
    _decode_stage2[(batch, num_heads)](
        mid_o,
        mid_lse,
        num_kv_splits,
        mid_lse,  # no sinks: a placeholder pointer, never read
        o,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        o.stride(0),
        o.stride(1),
        MAX_SPLITS=max_splits,
        BLOCK_S=next_pow2(max_splits),
        HEAD_DIM=latent,
        HAS_SINKS=False,
        num_warps=4 if latent <= 128 else 8,
    )
    return o
