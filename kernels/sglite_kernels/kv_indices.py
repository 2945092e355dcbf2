"""CSR slot lists: flatten rows of the request-to-token table into ``kv_indices``.

``kv_indices[kv_indptr[b] + i] = req_to_token[req_pool_indices[b], i]`` for i < lens[b]. This
is the per-forward metadata of the attention kernels, built on the device without a host sync
(a boolean-mask gather in torch would sync on its output size).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_index, check_same_device


@triton.jit
def _fill_kernel(ReqToToken, RowIdx, Lens, KvIndptr, KvIndices, stride_row, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(RowIdx + b).to(tl.int64)
    length = tl.load(Lens + b)
    out_start = tl.load(KvIndptr + b).to(tl.int64)
    for start in range(0, length, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < length
        slots = tl.load(ReqToToken + row * stride_row + offs, mask=mask)
        tl.store(KvIndices + out_start + offs, slots.to(KvIndices.dtype.element_ty), mask=mask)


def fill_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> torch.Tensor:
    """Write each request's first lens[b] slots into kv_indices at kv_indptr[b]; returns it.

    req_to_token: [num_rows, max_context] int32/int64, row-contiguous; req_pool_indices, lens:
    [B]; kv_indptr: [B+1] (the exclusive cumsum of lens); kv_indices: >= sum(lens) entries.
    """
    if req_to_token.dim() != 2 or req_to_token.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"req_to_token must be a 2-D int32/int64 table, got {req_to_token.dtype} "
            f"{tuple(req_to_token.shape)}"
        )
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token rows must be contiguous")
    batch = req_pool_indices.shape[0] if req_pool_indices.dim() == 1 else -1
    check_index("req_pool_indices", req_pool_indices)
    check_index("lens", lens, batch)
    check_index("kv_indptr", kv_indptr, batch + 1)
    check_index("kv_indices", kv_indices)
    check_same_device(
        req_to_token=req_to_token,
        req_pool_indices=req_pool_indices,
        lens=lens,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
    )
    if batch > 0:
        _fill_kernel[(batch,)](
            req_to_token,
            req_pool_indices,
            lens,
            kv_indptr,
            kv_indices,
            req_to_token.stride(0),
            BLOCK=512,
        )
    return kv_indices
