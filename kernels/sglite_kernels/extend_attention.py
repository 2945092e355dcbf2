"""Extend (prefill) attention: new tokens attend to their cached prefix and causally to themselves.

Request b's new tokens are rows ``qo_indptr[b] : qo_indptr[b+1]`` of q [T, Hq, D] and of this
step's k/v [T, Hkv, D]; its cached prefix is the slots ``kv_indices[kv_indptr[b] :
kv_indptr[b+1]]`` of k_buffer/v_buffer [num_slots, Hkv, D] (CSR over slot ids, as in decode,
so any page size works). The prefix excludes the new tokens: they are read from the
contiguous k/v tensors, which is cheaper than gathering them back from the pool.

Grid (ceil(max_extend_len / BLOCK_M), B, Hq). A program holds BLOCK_M queries of one head and
runs one online softmax (base 2) over stage 1, the prefix tiles (no mask but the length), then
stage 2, the new-token tiles up to its own last query (causal mask ``key_pos <= query_pos``).
A decode row in a mixed batch is a 1-token extend with its whole history as prefix.

Variations: a sliding window W lets query position p see key positions p - W < j <= p only;
both stages then start at the first key the block's earliest query sees (a long prefix
costs its last W keys, not all of them). A logit cap turns the scores into
cap * tanh(score / cap); sinks (one logit per query head) join the final denominator.
"""

from __future__ import annotations

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
    soft_cap,
    tile_dot,
    window_arg,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    KBuf,
    VBuf,
    QoIndptr,
    KvIndptr,
    KvIndices,
    Sinks,
    sm_scale_log2,
    cap_log2,
    window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    m_block = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(QoIndptr + b).to(tl.int64)
    q_len = (tl.load(QoIndptr + b + 1) - q_start).to(tl.int32)
    if m_block * BLOCK_M < q_len:
        kv_start = tl.load(KvIndptr + b).to(tl.int64)
        prefix_len = (tl.load(KvIndptr + b + 1) - kv_start).to(tl.int32)
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < q_len
        offs_d = tl.arange(0, HEAD_DIM)
        rows_m = q_start + offs_m
        q = tl.load(
            Q + rows_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=mask_m[:, None],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

        # Stage 1: the cached prefix, gathered through the slot list, from the first key the
        # block's first query sees. Positions: query prefix_len + m, prefix key n.
        q_pos = prefix_len + offs_m
        lo = tl.maximum(prefix_len + m_block * BLOCK_M - window + 1, 0)
        for start in range(lo, prefix_len, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < prefix_len
            slot = tl.load(KvIndices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            k = tl.load(
                KBuf + slot[:, None] * stride_kbt + kvh * stride_kbh + offs_d[None, :],
                mask=mask_n[:, None],
                other=0.0,
            )
            qk = tile_dot(q, tl.trans(k), DOT_FP32, PRECISION) * sm_scale_log2
            if HAS_CAP:
                qk = soft_cap(qk, cap_log2)
            visible = mask_n[None, :] & (offs_n[None, :] > q_pos[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
            # a row the window hides this whole tile from keeps m = -inf: subtract 0 instead
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_sub)
            p = tl.exp2(qk - m_sub[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                VBuf + slot[:, None] * stride_vbt + kvh * stride_vbh + offs_d[None, :],
                mask=mask_n[:, None],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, DOT_FP32, PRECISION)
            m_i = m_new

        # Stage 2: the new tokens, causally; key n is visible to query m iff n <= m (and
        # m - window < n).
        stop = tl.minimum(q_len, (m_block + 1) * BLOCK_M)
        lo = tl.maximum(m_block * BLOCK_M - window + 1, 0)
        for start in range(lo, stop, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < q_len
            rows_n = q_start + offs_n
            k = tl.load(
                K + rows_n[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                mask=mask_n[:, None],
                other=0.0,
            )
            qk = tile_dot(q, tl.trans(k), DOT_FP32, PRECISION) * sm_scale_log2
            if HAS_CAP:
                qk = soft_cap(qk, cap_log2)
            visible = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])
            visible &= offs_n[None, :] > offs_m[:, None] - window
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_sub)
            p = tl.exp2(qk - m_sub[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                V + rows_n[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                mask=mask_n[:, None],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, DOT_FP32, PRECISION)
            m_i = m_new

        # Every real row sees its own key, so l_i > 0 there; padding rows may see none.
        denom = l_i
        if HAS_SINKS:
            denom += tl.exp2(tl.load(Sinks + h) * 1.4426950408889634 - m_i)
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(
            Out + rows_m[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=mask_m[:, None],
        )


def _config(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); untuned defaults."""
    if head_dim <= 64:
        return 64, 64, 4, 2
    if head_dim <= 128:
        return 64, 64, 8, 2
    return 32, 32, 8, 2


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
    *,
    window: int | None = None,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens over prefix + themselves, written into o; returns o.

    q, o: [T, Hq, D]; k, v: [T, Hkv, D] (this step's keys/values, any token/head strides);
    k_buffer, v_buffer: [num_slots, Hkv, D]; qo_indptr, kv_indptr: [B+1]; kv_indices: the
    prefix slot ids; max_extend_len >= every request's new-token count (sizes the grid).
    ``window``: query position p sees key positions p - window < j <= p (None: all <= p);
    ``logit_cap`` > 0: scores s become cap * tanh(s / cap); ``sinks``: float32 [Hq] logits
    added to each head's softmax denominator only.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o)):
        check_float(name, t, 3)
    check_float("k_buffer", k_buffer, 3)
    check_float("v_buffer", v_buffer, 3)
    check_same_dtype(q=q, k=k, v=v, o=o, k_buffer=k_buffer, v_buffer=v_buffer)
    num_tokens, num_q_heads, head_dim = q.shape
    check_index("qo_indptr", qo_indptr)
    batch = qo_indptr.shape[0] - 1
    check_index("kv_indptr", kv_indptr, batch + 1)
    check_index("kv_indices", kv_indices)
    check_same_device(
        q=q,
        k=k,
        v=v,
        o=o,
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        qo_indptr=qo_indptr,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
    )
    if o.shape != q.shape:
        raise ValueError(f"o must have q's shape {tuple(q.shape)}, got {tuple(o.shape)}")
    if k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(
            f"k and v must both be [{num_tokens}, Hkv, {head_dim}], got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k_buffer.shape != v_buffer.shape or k_buffer.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"k_buffer and v_buffer must both be [num_slots, {k.shape[1]}, {head_dim}], got "
            f"{tuple(k_buffer.shape)} and {tuple(v_buffer.shape)}"
        )
    check_heads(num_q_heads, k.shape[1])
    check_head_dim(head_dim)
    check_variant(logit_cap, sinks, num_q_heads, q.device)
    window = window_arg(window)
    if batch < 0:
        raise ValueError("qo_indptr must have at least one entry")
    if batch == 0 or num_tokens == 0:
        return o
    if max_extend_len < 1:
        raise ValueError(f"max_extend_len must be >= 1, got {max_extend_len}")

    cfg_m, cfg_n, num_warps, num_stages = _config(head_dim)
    block_m = block_m or cfg_m
    block_n = block_n or cfg_n
    grid = (triton.cdiv(max_extend_len, block_m), batch, num_q_heads)
    _extend_kernel[grid](
        q,
        k,
        v,
        o,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        sinks if sinks is not None else q,  # a placeholder pointer, never read
        sm_scale * _LOG2E,
        logit_cap * _LOG2E,
        window,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        o.stride(0),
        o.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        GROUP=num_q_heads // k.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION=dot_precision(q.dtype),
        DOT_FP32=dot_in_fp32(q),
        HAS_CAP=logit_cap > 0,
        HAS_SINKS=sinks is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return o
