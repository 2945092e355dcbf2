"""Token embedding and LM head over a GGUF table kept as the file's blocks.

The twins of `sglite.layers.vocab_parallel_embedding`'s layers, with the same vocabulary
shards (rank r: rows `[r * shard, (r+1) * shard)`, the last shard short): the table is
`PackedRows` (or `DenseRows` for a float table) of this rank's rows, usually a view of the
mmap'd file. The embedding dequantizes only the rows it looks up; the LM head is a
`PackedWeight` matmul (the native GEMV / GEMM), its logits padded to the shard size before
the all-gather, so the ranks' shards line up as in the float head. Tied embeddings share the
one table.
"""

from __future__ import annotations

import torch
from torch import nn

from sglite.distributed import NULL_TP_GROUP, TPGroup
from sglite.layers import quant_kernels
from sglite.layers.quant_formats import dequantize
from sglite.layers.quant_linear import DenseRows, PackedRows, PackedWeight, Rows


class QuantVocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | None = None,
        tp_group: TPGroup = NULL_TP_GROUP,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.tp_size, self.tp_rank, self.tp_group = tp_group.size, tp_group.rank, tp_group
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = min(num_embeddings, self.vocab_start + self.shard_size)
        self.table: Rows | None = None
        self.packed = PackedWeight(self.vocab_end - self.vocab_start, embedding_dim)

    def load_packed(self, rows: Rows, shard_id: str | int | None = None) -> None:
        """The whole checkpoint table; this rank keeps its shard of the rows."""
        if rows.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"{type(self).__name__}: checkpoint tensor has shape {tuple(rows.shape)}, "
                f"the model expects ({self.num_embeddings}, {self.embedding_dim})"
            )
        self.table = rows.narrow(0, self.vocab_start, self.vocab_end - self.vocab_start)
        self.packed.put(0, self.table, None, type(self).__name__)

    @property
    def is_loaded(self) -> bool:
        return self.table is not None

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 `[len(ids), embedding_dim]`: the table's rows at `ids` (local row numbers)."""
        table = self.table
        if table is None:
            raise ValueError(f"{type(self).__name__}: the table is not loaded")
        if isinstance(table, DenseRows):
            return table.data.index_select(0, ids)
        assert isinstance(table, PackedRows)
        rows = table.data.index_select(0, ids)
        if quant_kernels.unavailable_reason() is None and rows.device.type == "cpu":
            return quant_kernels.dequantize(table.qtype, rows, self.embedding_dim)
        return dequantize(table.qtype, rows, self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1).to(torch.int64)
        if self.tp_size == 1:
            out = self._rows(flat).to(self.dtype)
            return out.reshape(*input_ids.shape, self.embedding_dim)
        in_range = (flat >= self.vocab_start) & (flat < self.vocab_end)
        local = (flat - self.vocab_start) * in_range
        out = self._rows(local).to(dtype=self.dtype) * in_range.unsqueeze(-1).to(self.dtype)
        return self.tp_group.all_reduce(out.reshape(*input_ids.shape, self.embedding_dim))


class QuantParallelLMHead(QuantVocabParallelEmbedding):
    """`logits = hidden @ table^T` over this rank's vocabulary shard (no bias: GGUF LM heads
    have none in the supported architectures)."""

    def __init__(self, *args, bias: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if bias:
            raise ValueError("a packed LM head with a bias is not supported")
        self._tied: QuantVocabParallelEmbedding | None = None

    def tie_to(self, embedding: QuantVocabParallelEmbedding) -> None:
        """Share the embedding's table (tie_word_embeddings): loaded when it is."""
        self._tied = embedding

    @property
    def is_loaded(self) -> bool:
        return self.table is not None or (self._tied is not None and self._tied.is_loaded)

    def prepack(self) -> bool:
        """Repack the weight it multiplies by (the tied embedding's table, or its own)."""
        return (self._tied.packed if self._tied is not None else self.packed).repack()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        packed = self._tied.packed if self._tied is not None else self.packed
        logits = packed.matmul(hidden)
        if self.tp_size == 1:
            return logits
        pad = self.shard_size - logits.shape[-1]
        if pad:
            logits = torch.nn.functional.pad(logits, (0, pad))
        return self.tp_group.all_gather(logits, dim=-1)[..., : self.num_embeddings]
