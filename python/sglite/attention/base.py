"""The attention backend interface: how RadixAttention turns q/k/v into attention output.

Contract
- Construction: `Backend(runner)` with the `ModelRunner` (for its pools, model config,
  device and dtype). One backend instance serves every layer.
- `init_forward_metadata(batch)` is called once per forward, before the first layer. It
  builds whatever the layers share (slot index lists, masks, kernel metadata) from the
  batch's lengths and `req_to_token` rows and keeps it on the backend until the next call.
  It must not write the KV pool.
- For each layer, `RadixAttention` first calls `save_kv(layer, batch, k, v)` (default:
  `batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)`; a backend may override
  it with a fused store kernel), then `forward(q, k, v, layer, batch)`. So when `forward`
  runs, this step's K/V are already in the pool at `out_cache_loc` and the rows of
  `req_to_token` cover positions 0 .. seq_len-1 of every request.
- Shapes: q `[T, num_heads, head_dim]`, k and v `[T, num_kv_heads, head_dim]` (this step's
  new tokens only, T = batch.num_tokens), `num_heads % num_kv_heads == 0` (GQA: query head
  h reads KV head h // (num_heads // num_kv_heads)). Returns `[T, num_heads, head_dim]` in
  q's dtype. Softmax scale is `layer.scaling`.
- Extend/mixed: token t of request i (position p = prefix_len_i + t) attends to positions
  0..p of request i (its cached prefix, then causally within the new tokens). Decode: the
  single new token attends to positions 0..seq_len-1.
- `forward` must not change `batch` or the pools (other than what `save_kv` wrote).

CUDA graph hooks (capture/replay of decode) are added by the backends that support them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglite.layers.radix_attention import RadixAttention
    from sglite.model_executor.forward_batch import ForwardBatch
    from sglite.model_executor.model_runner import ModelRunner


class AttentionBackend(ABC):
    """Paged attention over the KV pool. See the module docstring for the contract."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare the per-forward metadata every layer of this batch shares."""

    def save_kv(
        self, layer: RadixAttention, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store this step's K/V at `batch.out_cache_loc`."""
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        if batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, batch)
        return self.forward_extend(q, k, v, layer, batch)

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Extend and mixed batches."""

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Decode batches (one new token per request)."""
