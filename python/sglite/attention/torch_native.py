"""torch_native attention: SDPA over K/V gathered from the pool; the CPU path and the reference.

Per forward, `init_forward_metadata` turns the batch's `req_to_token` rows into one padded
slot matrix `[B, max_seq_len]` and a mask; every layer then does one gather (index_select)
of K and V and one SDPA call for the whole batch, with no per-request Python loop.

- Decode: the query heads of one KV group attend together (q viewed as
  `[B, num_kv_heads, group, D]`), so GQA needs no copy of K/V. Rows shorter than the
  longest are masked; with equal lengths there is no mask at all.
- Extend/mixed: queries are padded to `[B, max_extend_len]`; query i of request b sees key j
  iff `j <= prefix_len_b + i` and `j < seq_len_b` (padded query rows see at least key 0, so
  no row is fully masked). One request without a cached prefix skips the gather and runs a
  causal SDPA on this step's K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from sglite.attention.base import AttentionBackend

if TYPE_CHECKING:
    from sglite.layers.radix_attention import RadixAttention
    from sglite.model_executor.forward_batch import ForwardBatch


@dataclass(frozen=True, eq=False)
class _Metadata:
    kv_slots: torch.Tensor | None  # [B * max_seq_len] int64, None: use this step's K/V
    max_seq_len: int
    mask: torch.Tensor | None  # bool, broadcastable to the SDPA scores; None: no mask
    causal: bool = False
    # Extend only: padded query rows -> token index, and real rows of the padded output.
    q_index: torch.Tensor | None = None
    max_extend_len: int = 0
    out_index: torch.Tensor | None = None


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, runner) -> None:
        super().__init__(runner)
        self._meta: _Metadata | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.forward_mode.is_decode():
            self._meta = self._decode_metadata(batch)
        else:
            self._meta = self._extend_metadata(batch)

    # ------------------------------------------------------------------ metadata
    def _slots(self, batch: ForwardBatch, max_seq_len: int) -> torch.Tensor:
        table = batch.req_to_token_pool.req_to_token
        rows = table.index_select(0, batch.req_pool_indices)[:, :max_seq_len]
        return rows.reshape(-1).to(torch.int64)

    def _decode_metadata(self, batch: ForwardBatch) -> _Metadata:
        max_len = max(batch.seq_lens_cpu)
        mask = None
        if min(batch.seq_lens_cpu) != max_len:
            keys = torch.arange(max_len, device=batch.seq_lens.device)
            mask = (keys < batch.seq_lens.unsqueeze(1)).view(batch.batch_size, 1, 1, max_len)
        return _Metadata(self._slots(batch, max_len), max_len, mask)

    def _extend_metadata(self, batch: ForwardBatch) -> _Metadata:
        prefix = batch.extend_prefix_lens_cpu
        ext = batch.extend_seq_lens_cpu
        if len(ext) == 1 and prefix[0] == 0:
            return _Metadata(None, ext[0], None, causal=True)
        device = batch.seq_lens.device
        bs, max_len, max_ext = batch.batch_size, max(batch.seq_lens_cpu), max(ext)
        lens = np.asarray(ext, dtype=np.int64)
        q_index = out_index = None
        if min(ext) != max_ext:
            starts = np.cumsum(lens) - lens
            i = np.arange(max_ext, dtype=np.int64)
            q_index = torch.from_numpy(
                (starts[:, None] + np.minimum(i[None, :], lens[:, None] - 1)).ravel()
            ).to(device)
            real = (i[None, :] < lens[:, None]).ravel()
            out_index = torch.from_numpy(np.flatnonzero(real)).to(device)
        keys = torch.arange(max_len, device=device).view(1, 1, max_len)
        q_pos = batch.extend_prefix_lens.view(bs, 1, 1) + torch.arange(max_ext, device=device).view(
            1, max_ext, 1
        )
        mask = (keys <= q_pos) & (keys < batch.seq_lens.view(bs, 1, 1))
        return _Metadata(
            self._slots(batch, max_len),
            max_len,
            mask.unsqueeze(1),
            q_index=q_index,
            max_extend_len=max_ext,
            out_index=out_index,
        )

    # ------------------------------------------------------------------ forward
    def _gather_kv(
        self, layer: RadixAttention, batch: ForwardBatch, meta: _Metadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the batch as `[B, num_kv_heads, max_seq_len, D]` (strided views)."""
        shape = (batch.batch_size, meta.max_seq_len, layer.num_kv_heads, layer.head_dim)
        k = batch.kv_pool.k_buffer[layer.layer_id].index_select(0, meta.kv_slots)
        v = batch.kv_pool.v_buffer[layer.layer_id].index_select(0, meta.kv_slots)
        return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        meta = self._meta
        keys, values = self._gather_kv(layer, batch, meta)
        bs, num_kv = batch.batch_size, layer.num_kv_heads
        group = layer.num_heads // num_kv
        q = q.view(bs, num_kv, group, layer.head_dim)
        out = F.scaled_dot_product_attention(
            q, keys.to(q.dtype), values.to(q.dtype), attn_mask=meta.mask, scale=layer.scaling
        )
        return out.view(bs, layer.num_heads, layer.head_dim)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        meta = self._meta
        gqa = layer.num_heads != layer.num_kv_heads
        if meta.causal:  # one request, nothing cached: this step's K/V are the whole sequence
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.transpose(0, 1).to(q.dtype),
                v.transpose(0, 1).to(q.dtype),
                is_causal=True,
                scale=layer.scaling,
                enable_gqa=gqa,
            )
            return out.transpose(0, 1)
        keys, values = self._gather_kv(layer, batch, meta)
        bs, max_ext = batch.batch_size, meta.max_extend_len
        if meta.q_index is not None:
            q = q.index_select(0, meta.q_index)
        q = q.view(bs, max_ext, layer.num_heads, layer.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q,
            keys.to(q.dtype),
            values.to(q.dtype),
            attn_mask=meta.mask,
            scale=layer.scaling,
            enable_gqa=gqa,
        )
        out = out.transpose(1, 2).reshape(bs * max_ext, layer.num_heads, layer.head_dim)
        if meta.out_index is not None:
            out = out.index_select(0, meta.out_index)
        return out
