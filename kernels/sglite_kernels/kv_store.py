"""KV store: scatter this step's K/V rows into the pool buffers at their slots.

k, v: [T, Hkv, D] (any token/head strides; head_dim contiguous), typically views into the
fused qkv projection. k_buffer, v_buffer: [num_slots, Hkv, D] of the same dtype (an fp8 pool:
the caller casts k and v first, with saturation: sglite.mem_cache.kv_dtype), rows indexed
by slot id. loc: [T] int32/int64 slot ids. Row t of k/v lands in row loc[t] of the buffers.
Slots are not bounds-checked on the device (that would need a sync): the allocator owns them.
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
)


@triton.jit
def _store_kernel(
    K,
    V,
    KBuf,
    VBuf,
    Loc,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # Program (i, h) moves BLOCK_T tokens of head h: a [BLOCK_T, D] tile whose rows are
    # HEAD_DIM-contiguous, so loads and stores vectorise.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    mask_t = offs_t < num_tokens
    offs_d = tl.arange(0, HEAD_DIM)
    slot = tl.load(Loc + offs_t, mask=mask_t, other=0).to(tl.int64)
    row = offs_t.to(tl.int64)
    mask = mask_t[:, None]
    k = tl.load(K + row[:, None] * stride_kt + h * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + row[:, None] * stride_vt + h * stride_vh + offs_d[None, :], mask=mask)
    tl.store(KBuf + slot[:, None] * stride_kbt + h * stride_kbh + offs_d[None, :], k, mask=mask)
    tl.store(VBuf + slot[:, None] * stride_vbt + h * stride_vbh + offs_d[None, :], v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
) -> None:
    """Write k[t], v[t] into k_buffer[loc[t]], v_buffer[loc[t]] for every token t."""
    for name, t in (("k", k), ("v", v), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        check_float(name, t, 3, kv=True)
    check_index("loc", loc, k.shape[0])
    check_same_dtype(k=k, v=v, k_buffer=k_buffer, v_buffer=v_buffer)
    check_same_device(k=k, v=v, k_buffer=k_buffer, v_buffer=v_buffer, loc=loc)
    if v.shape != k.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_buffer.shape[1:] != k.shape[1:] or v_buffer.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"buffers must be [num_slots, {k.shape[1]}, {k.shape[2]}] like k's rows, got "
            f"k_buffer {tuple(k_buffer.shape)} and v_buffer {tuple(v_buffer.shape)}"
        )
    check_head_dim(k.shape[2])
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_t = 16 if head_dim <= 128 else 8
    grid = (triton.cdiv(num_tokens, block_t), num_heads)
    _store_kernel[grid](
        k,
        v,
        k_buffer,
        v_buffer,
        loc,
        num_tokens,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        num_warps=4,
    )
