"""Launcher of the native CPU decode-attention kernel (`sglite._core.decode_attention`).

The kernel (rust/attn) reads K/V in place from one layer of the KV pool: query row i attends
to the slots `table[rows[i], :seq_lens[i]]`, GQA query head h to KV head
`h // (num_heads // num_kv_heads)`. This module checks the layout contract (CPU, dtype,
shape, contiguity), keeps the tensors alive for the call and returns the output.
"""

from __future__ import annotations

import torch

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def unavailable_reason() -> str | None:
    """None when the kernel can run here, else why not."""
    try:
        from sglite import _core
    except ImportError as e:
        return f"the native module sglite._core does not import ({e})"
    if not hasattr(_core, "decode_attention"):
        return "the native module sglite._core is older than this package; reinstall it"
    return None


def supports_dtype(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES


def _raw(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel()


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_threads: int | None = None,
) -> torch.Tensor:
    """q `[n, H, D]`, k/v `[num_slots, KVH, D]`, table int32 `[R, W]`, rows/seq_lens int64 `[n]`."""
    from sglite import _core

    if q.dim() != 3 or k_buffer.dim() != 3 or k_buffer.shape != v_buffer.shape:
        raise ValueError(
            f"decode_attention: q must be [n, H, D] and k/v [slots, KVH, D] alike; got "
            f"{tuple(q.shape)}, {tuple(k_buffer.shape)}, {tuple(v_buffer.shape)}"
        )
    n, num_heads, head_dim = q.shape
    if k_buffer.shape[2] != head_dim:
        raise ValueError(f"decode_attention: head_dim {head_dim} vs K/V {k_buffer.shape[2]}")
    if q.dtype not in _DTYPES or k_buffer.dtype != q.dtype or v_buffer.dtype != q.dtype:
        raise ValueError(
            f"decode_attention: q, k, v must all be float32 or all bfloat16; got "
            f"{q.dtype}, {k_buffer.dtype}, {v_buffer.dtype}"
        )
    if table.dtype != torch.int32 or table.dim() != 2:
        raise ValueError(f"decode_attention: table must be 2-D int32, got {table.dtype}")
    if rows.dtype != torch.int64 or seq_lens.dtype != torch.int64:
        raise ValueError("decode_attention: rows and seq_lens must be int64")
    if rows.shape != (n,) or seq_lens.shape != (n,):
        raise ValueError(
            f"decode_attention: rows {tuple(rows.shape)} and seq_lens {tuple(seq_lens.shape)} "
            f"must both be [{n}]"
        )
    tensors = (q, k_buffer, v_buffer, table, rows, seq_lens)
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("decode_attention: every tensor must be on the CPU")
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("decode_attention: every tensor must be contiguous")
    out = torch.empty_like(q)
    _core.decode_attention(
        _raw(q),
        _raw(k_buffer),
        _raw(v_buffer),
        _raw(out),
        _raw(table),
        table.shape[1],
        _raw(rows),
        _raw(seq_lens),
        num_heads,
        k_buffer.shape[1],
        head_dim,
        float(scale),
        _DTYPES[q.dtype],
        num_threads if num_threads is not None else torch.get_num_threads(),
    )
    return out
