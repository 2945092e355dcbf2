"""Split-KV decode attention over the paged KV pool (one query token per request).

Addressing is CSR over slot ids: request b's cached tokens are the rows
``kv_indices[kv_indptr[b] : kv_indptr[b+1]]`` of ``k_buffer``/``v_buffer`` ([num_slots, Hkv, D]).
A sliding window W keeps only the last W of them: the programs start there (the list still
holds every position, so one list serves the layers of every window). A logit cap turns the
scores into cap * tanh(score / cap); sinks (one logit per query head) join the denominator
in stage 2.
Slot-level indices cover every page size: a page of size P is the slots p*P .. p*P+P-1, and
since the pool is token-major a page never makes one head's rows contiguous, so a page-table
form would only save the 4-byte index per token (under 1% of the K/V bytes read).

Stage 1, grid (B, Hkv, max_splits): program (b, g, s) takes split s of request b's tokens for
KV head g and all G = Hq/Hkv query heads of that group at once (a [BLOCK_H, D] query tile), so
every K/V tile is loaded once per KV head and fed to ``tl.dot``. It runs an online softmax
(base 2) and stores the split's normalised output and its log2-sum-exp. Stage 2, grid (B, Hq),
merges the splits by log-sum-exp. Splits past ``num_kv_splits[b]`` do nothing, so the grid
depends only on the batch size and ``max_splits`` (CUDA-graph friendly).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import (
    check_float,
    check_head_dim,
    check_heads,
    check_index,
    check_same_device,
    check_same_dtype,
    check_variant,
    dot_in_fp32,
    dot_precision,
    next_pow2,
    soft_cap,
    tile_dot,
    window_arg,
)

_LOG2E = 1.4426950408889634
# A split shorter than this costs more in stage-2 traffic and launch tail than it gains.
MIN_SPLIT_LEN = 256


def num_kv_splits(
    seq_lens: torch.Tensor, num_kv_heads: int, num_sms: int, max_splits: int
) -> torch.Tensor:
    """Per-request split counts, int32 [B], computed on the device without a host sync.
    Under a sliding window W, pass ``seq_lens.clamp(max=W)`` (the keys a row reads).

    Enough splits that the stage-1 grid has about 4 programs per SM (B*Hkv programs per split
    level), but no split shorter than MIN_SPLIT_LEN tokens and never more than max_splits.
    """
    batch = seq_lens.shape[0]
    wanted = max(1, min(max_splits, math.ceil(4 * num_sms / max(1, batch * num_kv_heads))))
    by_len = torch.div(seq_lens + (MIN_SPLIT_LEN - 1), MIN_SPLIT_LEN, rounding_mode="floor")
    return by_len.clamp(min=1, max=wanted).to(torch.int32)


@triton.jit
def _decode_stage1(
    Q,
    K,
    V,
    KvIndptr,
    KvIndices,
    NumSplits,
    MidO,
    MidLse,
    sm_scale_log2,
    cap_log2,
    window,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_CAP: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    # Clamped so that a bad count can drop no tokens and read no unwritten scratch.
    n_splits = tl.minimum(tl.maximum(tl.load(NumSplits + b), 1), MAX_SPLITS)
    if s < n_splits:
        kv_start = tl.load(KvIndptr + b).to(tl.int64)
        kv_len = (tl.load(KvIndptr + b + 1) - kv_start).to(tl.int32)
        skip = tl.maximum(kv_len - window, 0)  # the keys before the window
        kv_start += skip
        kv_len -= skip
        # Split boundaries are BLOCK_N-aligned so only the last tile of a split is ragged.
        split_len = tl.cdiv(tl.cdiv(kv_len, n_splits), BLOCK_N) * BLOCK_N
        lo = s * split_len
        hi = tl.minimum(lo + split_len, kv_len)

        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < GROUP
        heads = g * GROUP + offs_h
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None],
            other=0.0,
        )
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        k_base = K + g * stride_kh
        v_base = V + g * stride_vh
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            slot = tl.load(KvIndices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            k = tl.load(
                k_base + slot[:, None] * stride_kt + offs_d[None, :],
                mask=mask_n[:, None],
                other=0.0,
            )
            qk = tile_dot(q, tl.trans(k), DOT_FP32, PRECISION) * sm_scale_log2
            if HAS_CAP:
                qk = soft_cap(qk, cap_log2)
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base + slot[:, None] * stride_vt + offs_d[None, :],
                mask=mask_n[:, None],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, DOT_FP32, PRECISION)
            m_i = m_new

        # An empty split (lo >= hi) leaves l_i == 0: it stores lse = -inf and weighs nothing.
        has_any = l_i > 0
        out = acc / tl.where(has_any, l_i, 1.0)[:, None]
        lse = tl.where(has_any, m_i + tl.log2(tl.where(has_any, l_i, 1.0)), float("-inf"))
        tl.store(
            MidO + b * stride_mob + heads[:, None] * stride_moh + s * stride_mos + offs_d[None, :],
            out,
            mask=mask_h[:, None],
        )
        tl.store(MidLse + b * stride_mlb + heads * stride_mlh + s, lse, mask=mask_h)


@triton.jit
def _decode_stage2(
    MidO,
    MidLse,
    NumSplits,
    Sinks,
    Out,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    MAX_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_splits = tl.minimum(tl.maximum(tl.load(NumSplits + b), 1), MAX_SPLITS)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < n_splits
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(
        MidLse + b * stride_mlb + h * stride_mlh + offs_s, mask=mask_s, other=float("-inf")
    )
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m))
    part = tl.load(
        MidO + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
        mask=mask_s[:, None],
        other=0.0,
    )
    total = tl.sum(w, 0)
    if HAS_SINKS:  # its weight exp(sink) on the same scale (base 2, relative to m)
        total += tl.exp2(tl.load(Sinks + h) * 1.4426950408889634 - m)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty))


def _stage1_config(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for stage 1; untuned defaults, see the bench."""
    if head_dim <= 64:
        return 64, 4, 3
    if head_dim <= 128:
        return 64, 4, 2
    return 32, 8, 2


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_kv_splits: torch.Tensor,
    max_splits: int,
    sm_scale: float,
    mid_o: torch.Tensor | None = None,
    mid_lse: torch.Tensor | None = None,
    *,
    window: int | None = None,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """o[b] = softmax(q[b] . K_b^T * sm_scale) V_b over request b's slots; returns o.

    ``window``: only the last ``window`` slots of each request (None: all); ``logit_cap``
    > 0: scores s become cap * tanh(s / cap); ``sinks``: float32 [Hq] logits added to each
    head's softmax denominator only. With a window, num_kv_splits counts splits of the
    windowed keys (see ``num_kv_splits``).

    q, o: [B, Hq, D]; k_buffer, v_buffer: [num_slots, Hkv, D]; kv_indptr: [B+1];
    kv_indices: slot ids; num_kv_splits: [B] in 1..max_splits (see ``num_kv_splits``; values
    outside are clamped on the device).
    mid_o [B, Hq, max_splits, D] / mid_lse [B, Hq, max_splits] (fp32) are scratch: pass them
    to avoid an allocation per call (CUDA-graph capture). block_n, num_warps and num_stages
    override stage 1's launch config (tests use small tiles; the bench sweeps them).
    """
    check_float("q", q, 3)
    check_float("o", o, 3)
    check_float("k_buffer", k_buffer, 3)
    check_float("v_buffer", v_buffer, 3)
    check_same_dtype(q=q, k_buffer=k_buffer, v_buffer=v_buffer, o=o)
    batch, num_q_heads, head_dim = q.shape
    check_index("kv_indptr", kv_indptr, batch + 1)
    check_index("kv_indices", kv_indices)
    check_index("num_kv_splits", num_kv_splits, batch)
    check_same_device(
        q=q,
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        o=o,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        num_kv_splits=num_kv_splits,
    )
    if o.shape != q.shape:
        raise ValueError(f"o must have q's shape {tuple(q.shape)}, got {tuple(o.shape)}")
    if k_buffer.shape != v_buffer.shape or k_buffer.shape[2] != head_dim:
        raise ValueError(
            f"k_buffer and v_buffer must both be [num_slots, Hkv, {head_dim}], got "
            f"{tuple(k_buffer.shape)} and {tuple(v_buffer.shape)}"
        )
    num_kv_heads = k_buffer.shape[1]
    check_heads(num_q_heads, num_kv_heads)
    check_head_dim(head_dim)
    check_variant(logit_cap, sinks, num_q_heads, q.device)
    window = window_arg(window)
    if max_splits < 1:
        raise ValueError(f"max_splits must be >= 1, got {max_splits}")
    mid_shape = (batch, num_q_heads, max_splits)
    if mid_o is None:
        mid_o = torch.empty((*mid_shape, head_dim), dtype=torch.float32, device=q.device)
    if mid_lse is None:
        mid_lse = torch.empty(mid_shape, dtype=torch.float32, device=q.device)
    for name, t, shape in (
        ("mid_o", mid_o, (*mid_shape, head_dim)),
        ("mid_lse", mid_lse, mid_shape),
    ):
        if t.dtype != torch.float32 or tuple(t.shape[: len(shape)]) != shape:
            raise ValueError(f"{name} must be float32 with leading shape {shape}")
        if t.stride(-1) != 1 or t.device != q.device:
            raise ValueError(f"{name} must be last-dim contiguous on {q.device}")
    if batch == 0:
        return o

    group = num_q_heads // num_kv_heads
    cfg_block_n, cfg_warps, cfg_stages = _stage1_config(head_dim)
    block_n = block_n or cfg_block_n
    num_warps = num_warps or cfg_warps
    num_stages = num_stages or cfg_stages
    _decode_stage1[(batch, num_kv_heads, max_splits)](
        q,
        k_buffer,
        v_buffer,
        kv_indptr,
        kv_indices,
        num_kv_splits,
        mid_o,
        mid_lse,
        sm_scale * _LOG2E,
        logit_cap * _LOG2E,
        window,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP=group,
        BLOCK_H=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        MAX_SPLITS=max_splits,
        PRECISION=dot_precision(q.dtype),
        DOT_FP32=dot_in_fp32(q),
        HAS_CAP=logit_cap > 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    _decode_stage2[(batch, num_q_heads)](
        mid_o,
        mid_lse,
        num_kv_splits,
        sinks if sinks is not None else mid_lse,  # a placeholder pointer, never read
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
        HEAD_DIM=head_dim,
        HAS_SINKS=sinks is not None,
        num_warps=4 if head_dim <= 128 else 8,
    )
    return o
