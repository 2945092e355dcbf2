"""The CPU attention backend: torch_native, with one-token rows computed by the native kernel.

Decode batches and the decode rows of mixed batches attend through
`sglite.attention.cpu_kernel` (rust/attn), which reads each row's K/V in place from the
pool. torch_native gathers them into a padded copy in every layer instead, which on a
1,000-token context costs several times the decode step's matrix multiplications. Requests
with several new tokens (prefill, chunks) keep torch_native's SDPA path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglite.attention import cpu_kernel
from sglite.attention.torch_native import TorchNativeAttnBackend

if TYPE_CHECKING:
    from sglite.layers.radix_attention import RadixAttention
    from sglite.model_executor.forward_batch import ForwardBatch


@dataclass(frozen=True, eq=False)
class _PoolRows:
    """One-token requests: their `req_to_token` rows and lengths, read by the kernel."""

    pool_rows: torch.Tensor  # [n] int64
    seq_lens: torch.Tensor  # [n] int64
    tokens: torch.Tensor | None = None  # their token indices in a mixed batch


class CpuAttnBackend(TorchNativeAttnBackend):
    def __init__(self, runner) -> None:
        reason = cpu_kernel.unavailable_reason()
        if reason is None and runner.device.type != "cpu":
            reason = f"it runs on the CPU, not {runner.device.type}"
        if reason is None and not cpu_kernel.supports_dtype(runner.kv_pool.dtype):
            reason = f"its kernel takes float32 or bfloat16 K/V, not {runner.kv_pool.dtype}"
        if reason is not None:
            raise ValueError(
                f"attention backend 'cpu' is unavailable: {reason}; "
                "use --attention-backend torch_native"
            )
        super().__init__(runner)

    def _rows(self, batch: ForwardBatch, which, seq_lens: list[int], tokens=None) -> _PoolRows:
        pool_rows = batch.req_pool_indices
        if len(which) != batch.batch_size:
            pool_rows = pool_rows[torch.tensor(list(which), device=pool_rows.device)]
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        return _PoolRows(pool_rows.to(torch.int64).contiguous(), lens, tokens)

    def _decode_rows(
        self, q: torch.Tensor, layer: RadixAttention, batch: ForwardBatch, rows: _PoolRows
    ) -> torch.Tensor:
        pool = batch.kv_pool
        k, v = pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id]
        table = batch.req_to_token_pool.req_to_token
        return cpu_kernel.decode_attention(
            q.to(k.dtype).contiguous(), k, v, table, rows.pool_rows, rows.seq_lens, layer.scaling
        ).to(q.dtype)
