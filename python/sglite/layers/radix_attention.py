"""RadixAttention: the attention layer of every model; stores this step's K/V, then attends.

The layer holds no state besides its shape; the KV pool and the backend come with the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from sglite.model_executor.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(
        self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """q `[T, Hq, D]` (or `[T, Hq*D]`), k/v `[T, Hkv, D]`; returns `[T, Hq*D]`."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        backend = batch.attn_backend
        backend.save_kv(self, batch, k, v)
        out = backend.forward(q, k, v, self, batch)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
