"""torch_native attention: SDPA over K/V gathered from the pool; the CPU path and the reference.

Per forward, the batch's `req_to_token` rows become slot index lists and masks that every
layer of one sliding window shares (built at the first layer that asks for that window, and
kept per window until the next forward); the cost of a layer is linear in the keys its
window lets the batch see (no query row is padded to another request's length, no key
before a row's window is read).

- Decode: one SDPA call for the whole batch over one padded slot matrix `[B, max_len]`
  (row i holds its last min(seq_len, W) positions); the query heads of one KV group attend
  together (q viewed as `[B, num_kv_heads, group, D]`), so GQA needs no copy of K/V. Rows
  shorter than the longest are masked; with equal lengths there is no mask at all.
- Extend/mixed: the requests with one new token (the decode rows of a mixed batch) run
  together exactly like a decode batch; each request with more new tokens runs its own SDPA
  call (a windowed one, a call per run of queries: `attend.plan_segment`) over its cached
  keys gathered from the pool, then this step's: query position p sees key j iff j <= p
  (and p - W < j). Without a cached prefix or a cutting window that is plain causal
  attention over this step's K/V (no gather, no mask).

Layers with a logit cap or sinks take the same metadata through `attend`'s written-out
softmax instead of SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglite.attention.attend import Piece, attend_rows, attend_tokens, piece_mask, plan_segment
from sglite.attention.base import AttentionBackend

if TYPE_CHECKING:
    from sglite.layers.radix_attention import RadixAttention
    from sglite.model_executor.forward_batch import ForwardBatch


@dataclass(frozen=True, eq=False)
class _Rows:
    """Requests that attend like a decode batch: one query token each."""

    kv_slots: torch.Tensor  # [B * max_len] int64: each row's window, left-aligned
    max_len: int
    mask: torch.Tensor | None  # [B, 1, 1, max_len] bool; None: all rows full length
    tokens: torch.Tensor | None = None  # their token indices in a mixed batch


@dataclass(frozen=True, eq=False)
class _Segment:
    """Queries: tokens `start .. start+length-1` of the step (one request's new tokens, or a
    run of them under a window). Keys: the cached slots `kv_slots` (None: none), then this
    step's tokens `new_start .. start+length-1`."""

    start: int
    length: int
    kv_slots: torch.Tensor | None
    new_start: int
    # [length, num_keys] bool; None: every cached key visible and the new ones causally
    # (torch_native always masks cached keys; the cpu backend merges two unmasked calls)
    mask: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class _Metadata:
    rows: _Rows | None
    segments: tuple[_Segment, ...] = ()


class TorchNativeAttnBackend(AttentionBackend):
    features = frozenset({"sliding_window", "logit_cap", "sinks"})
    # Segments with cached keys carry a mask (SDPA aligns is_causal top-left).
    mask_cached_keys = True

    def __init__(self, runner) -> None:
        super().__init__(runner)
        self._batch: ForwardBatch | None = None
        self._metas: dict[int | None, _Metadata] = {}

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._batch, self._metas = batch, {}

    def _meta(self, layer: RadixAttention) -> _Metadata:
        batch, window = self._batch, layer.sliding_window
        if window is not None and window >= max(batch.seq_lens_cpu, default=0):
            window = None  # wider than every sequence: full attention
        meta = self._metas.get(window)
        if meta is None:
            if batch.forward_mode.is_decode():
                rows = self._rows(batch, range(batch.batch_size), batch.seq_lens_cpu, window)
                meta = _Metadata(rows)
            else:
                meta = self._extend_metadata(batch, window)
            self._metas[window] = meta
        return meta

    # ------------------------------------------------------------------ metadata
    def _table(self, batch: ForwardBatch) -> torch.Tensor:
        return batch.req_to_token_pool.req_to_token

    def _rows(
        self, batch: ForwardBatch, which, seq_lens: list[int], window: int | None, tokens=None
    ) -> _Rows:
        device = batch.seq_lens.device
        starts = [max(0, n - window) for n in seq_lens] if window else [0] * len(seq_lens)
        lens = [n - s for n, s in zip(seq_lens, starts)]
        max_len = max(lens)
        if len(which) == batch.batch_size:
            pool_rows = batch.req_pool_indices
        else:
            pool_rows = batch.req_pool_indices[torch.tensor(list(which), device=device)]
        table = self._table(batch).index_select(0, pool_rows)
        if any(starts):
            cols = torch.tensor(starts, device=device).unsqueeze(1)
            cols = (cols + torch.arange(max_len, device=device)).clamp_(max=table.shape[1] - 1)
            slots = table.gather(1, cols)
        else:
            slots = table[:, :max_len]
        mask = None
        if min(lens) != max_len:
            keys = torch.arange(max_len, device=device)
            mask = keys < torch.tensor(lens, device=device).unsqueeze(1)
            mask = mask.view(len(lens), 1, 1, max_len)
        return _Rows(slots.reshape(-1).to(torch.int64), max_len, mask, tokens)

    def _extend_metadata(self, batch: ForwardBatch, window: int | None) -> _Metadata:
        device = batch.seq_lens.device
        table = self._table(batch)
        pool_rows = batch.req_pool_indices.tolist() if device.type == "cpu" else None
        singles, single_lens, single_tokens, segments = [], [], [], []
        start = 0
        for i, (prefix, ext) in enumerate(
            zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu)
        ):
            if ext == 1:
                singles.append(i)
                single_lens.append(prefix + 1)
                single_tokens.append(start)
            else:
                row = pool_rows[i] if pool_rows is not None else batch.req_pool_indices[i]
                for piece in plan_segment(prefix, ext, window):
                    segments.append(self._segment(table, row, start, prefix, piece, window))
            start += ext
        rows = None
        if singles:
            tokens = torch.tensor(single_tokens, device=device)
            rows = self._rows(batch, singles, single_lens, window, tokens)
        return _Metadata(rows, tuple(segments))

    def _segment(
        self, table: torch.Tensor, row, start: int, prefix: int, piece: Piece, window
    ) -> _Segment:
        slots = None
        if piece.cached_from < prefix:
            slots = table[row, piece.cached_from : prefix].to(torch.int64)
        mask = None
        if piece.cut or (slots is not None and self.mask_cached_keys):
            mask = piece_mask(piece, prefix, window, table.device)
        length = piece.q_to - piece.q_from
        return _Segment(start + piece.q_from, length, slots, start + piece.new_from, mask)

    # ------------------------------------------------------------------ forward
    def _decode_rows(
        self, q: torch.Tensor, layer: RadixAttention, batch: ForwardBatch, rows: _Rows
    ) -> torch.Tensor:
        """Attention of one query token per row: q `[n, H, D]` -> `[n, H, Dv]`."""
        n, num_kv, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        shape = (n, rows.max_len, num_kv, -1)
        pool = batch.kv_pool
        keys = pool.k_buffer[layer.layer_id].index_select(0, rows.kv_slots).view(shape)
        if pool.values_in_keys:  # MLA: the values are the keys' first v_head_dim dims
            values = keys[..., : layer.v_head_dim]
        else:
            values = pool.v_buffer[layer.layer_id].index_select(0, rows.kv_slots).view(shape)
        q = q.reshape(n, num_kv, layer.num_heads // num_kv, d)
        out = attend_rows(q, keys.transpose(1, 2), values.transpose(1, 2), layer, rows.mask)
        return out.reshape(n, layer.num_heads, layer.v_head_dim)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        return self._decode_rows(q, layer, batch, self._meta(layer).rows)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        meta = self._meta(layer)
        out = q.new_empty((*q.shape[:-1], layer.v_head_dim))
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
        """Attention of one segment's queries: `[seg.length, H, Dv]`."""
        end = seg.start + seg.length
        keys, values = k[seg.new_start : end], v[seg.new_start : end]
        if seg.kv_slots is not None:
            pool, layer_id = batch.kv_pool, layer.layer_id
            cached_k = pool.k_buffer[layer_id].index_select(0, seg.kv_slots)
            cached_v = pool.v_buffer[layer_id].index_select(0, seg.kv_slots)
            keys = torch.cat([cached_k.to(q.dtype), keys])
            values = torch.cat([cached_v.to(q.dtype), values])
        is_causal = seg.mask is None and seg.kv_slots is None
        return attend_tokens(q[seg.start : end], keys, values, layer, seg.mask, is_causal)
