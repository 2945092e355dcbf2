"""torch_native attention: SDPA over K/V gathered from the pool; the CPU path and the reference.

Per forward, `init_forward_metadata` turns the batch's `req_to_token` rows into slot index
lists and masks that every layer shares; the cost of a layer is linear in the real tokens
of the batch (no query row is padded to another request's length).

- Decode: one SDPA call for the whole batch over one padded slot matrix `[B, max_seq_len]`;
  the query heads of one KV group attend together (q viewed as `[B, num_kv_heads, group,
  D]`), so GQA needs no copy of K/V. Rows shorter than the longest are masked; with equal
  lengths there is no mask at all.
- Extend/mixed: the requests with one new token (the decode rows of a mixed batch) run
  together exactly like a decode batch; each request with more new tokens runs its own SDPA
  call over its own keys: query i sees key j iff `j <= prefix_len + i`. Without a cached
  prefix that is plain causal attention over this step's K/V (no gather, no mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sglite.attention.base import AttentionBackend

if TYPE_CHECKING:
    from sglite.layers.radix_attention import RadixAttention
    from sglite.model_executor.forward_batch import ForwardBatch


@dataclass(frozen=True, eq=False)
class _Rows:
    """Requests that attend like a decode batch: one query token each."""

    kv_slots: torch.Tensor  # [B * max_seq_len] int64
    max_seq_len: int
    mask: torch.Tensor | None  # [B, 1, 1, max_seq_len] bool; None: all rows full length
    tokens: torch.Tensor | None = None  # their token indices in a mixed batch


@dataclass(frozen=True, eq=False)
class _Segment:
    """One request with several new tokens: tokens `start .. start+length-1` of the step."""

    start: int
    length: int
    # pool slots of the keys it reads (None: this step's K/V are all it sees). torch_native:
    # the whole sequence, with `mask`; the cpu backend: the cached prefix only (the new
    # tokens' K/V come from this step's tensors) and no mask.
    kv_slots: torch.Tensor | None
    mask: torch.Tensor | None  # [length, seq_len] bool (key j <= prefix + i)


@dataclass(frozen=True, eq=False)
class _Metadata:
    rows: _Rows | None
    segments: tuple[_Segment, ...] = ()


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, runner) -> None:
        super().__init__(runner)
        self._meta: _Metadata | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.forward_mode.is_decode():
            rows = self._rows(batch, range(batch.batch_size), batch.seq_lens_cpu)
            self._meta = _Metadata(rows)
        else:
            self._meta = self._extend_metadata(batch)

    # ------------------------------------------------------------------ metadata
    def _table(self, batch: ForwardBatch) -> torch.Tensor:
        return batch.req_to_token_pool.req_to_token

    def _rows(self, batch: ForwardBatch, which, seq_lens: list[int], tokens=None) -> _Rows:
        device = batch.seq_lens.device
        max_len = max(seq_lens)
        if len(which) == batch.batch_size:
            pool_rows = batch.req_pool_indices
        else:
            pool_rows = batch.req_pool_indices[torch.tensor(list(which), device=device)]
        slots = self._table(batch).index_select(0, pool_rows)[:, :max_len]
        mask = None
        if min(seq_lens) != max_len:
            lens = torch.tensor(seq_lens, device=device)
            keys = torch.arange(max_len, device=device)
            mask = (keys < lens.unsqueeze(1)).view(len(seq_lens), 1, 1, max_len)
        return _Rows(slots.reshape(-1).to(torch.int64), max_len, mask, tokens)

    def _extend_metadata(self, batch: ForwardBatch) -> _Metadata:
        device = batch.seq_lens.device
        table = self._table(batch)
        pool_rows = batch.req_pool_indices.tolist() if device.type == "cpu" else None
        singles, single_lens, single_tokens, segments = [], [], [], []
        start = 0
        for i, (prefix, ext) in enumerate(
            zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu)
        ):
            seq = prefix + ext
            if ext == 1:
                singles.append(i)
                single_lens.append(seq)
                single_tokens.append(start)
            elif prefix == 0:
                segments.append(_Segment(start, ext, None, None))
            else:
                row = pool_rows[i] if pool_rows is not None else batch.req_pool_indices[i]
                segments.append(self._segment(table, row, start, prefix, ext))
            start += ext
        rows = None
        if singles:
            tokens = torch.tensor(single_tokens, device=device)
            rows = self._rows(batch, singles, single_lens, tokens)
        return _Metadata(rows, tuple(segments))

    def _segment(self, table: torch.Tensor, row, start: int, prefix: int, ext: int) -> _Segment:
        """A request extending a cached prefix: its whole sequence's slots, and the mask."""
        seq, device = prefix + ext, table.device
        slots = table[row, :seq].to(torch.int64)
        keys = torch.arange(seq, device=device)
        q_pos = torch.arange(prefix, seq, device=device).unsqueeze(1)
        return _Segment(start, ext, slots, keys <= q_pos)

    # ------------------------------------------------------------------ forward
    def _decode_rows(
        self, q: torch.Tensor, layer: RadixAttention, batch: ForwardBatch, rows: _Rows
    ) -> torch.Tensor:
        """Attention of one query token per row: q `[n, H, D]` -> `[n, H, D]`."""
        n, num_kv, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        shape = (n, rows.max_seq_len, num_kv, d)
        pool = batch.kv_pool
        keys = pool.k_buffer[layer.layer_id].index_select(0, rows.kv_slots).view(shape)
        values = pool.v_buffer[layer.layer_id].index_select(0, rows.kv_slots).view(shape)
        q = q.reshape(n, num_kv, layer.num_heads // num_kv, d)
        out = F.scaled_dot_product_attention(
            q,
            keys.transpose(1, 2).to(q.dtype),
            values.transpose(1, 2).to(q.dtype),
            attn_mask=rows.mask,
            scale=layer.scaling,
        )
        return out.view(n, layer.num_heads, d)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        return self._decode_rows(q, layer, batch, self._meta.rows)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        meta = self._meta
        out = torch.empty_like(q)
        for seg in meta.segments:
            out[seg.start : seg.start + seg.length] = self._attend_segment(
                q, k, v, layer, batch, seg
            )
        if meta.rows is not None:
            rows = meta.rows
            out[rows.tokens] = self._decode_rows(q[rows.tokens], layer, batch, rows)
        return out

    def _attend_segment(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        batch: ForwardBatch,
        seg: _Segment,
    ) -> torch.Tensor:
        """Attention of one request's new tokens: `[seg.length, H, D]`."""
        end = seg.start + seg.length
        if seg.kv_slots is None:  # nothing cached: this step's K/V are the whole sequence
            keys, values = k[seg.start : end], v[seg.start : end]
        else:
            keys = batch.kv_pool.k_buffer[layer.layer_id].index_select(0, seg.kv_slots)
            values = batch.kv_pool.v_buffer[layer.layer_id].index_select(0, seg.kv_slots)
        return F.scaled_dot_product_attention(
            q[seg.start : end].transpose(0, 1),
            keys.transpose(0, 1).to(q.dtype),
            values.transpose(0, 1).to(q.dtype),
            attn_mask=seg.mask,
            is_causal=seg.mask is None,
            scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        ).transpose(0, 1)
