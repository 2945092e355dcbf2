"""Token embedding and LM head, split along the vocabulary for tensor parallelism.

Rank r holds the rows [r * shard, (r+1) * shard) of the [vocab, hidden] table, shard =
ceil(vocab / tp_size) (the last shard is zero-padded). Ids outside a rank's range embed to
zero there, so an all-reduce over ranks recovers the full lookup. The LM head is the same
table used as a matmul; with tied embeddings it shares the weight. It computes the logits of
its shard, all-gathers them over the ranks (every shard has `shard_size` columns, padding
last) and trims them to the real vocabulary, so every rank has the full logits. With
tp_size 1 neither layer communicates.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from sglite.distributed import NULL_TP_GROUP, TPGroup
from sglite.layers.linear import can_prepack

logger = logging.getLogger(__name__)


class VocabParallelEmbedding(nn.Module):
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
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        tp_size, tp_rank = tp_group.size, tp_group.rank
        self.tp_size, self.tp_rank, self.tp_group = tp_size, tp_rank, tp_group
        self.shard_size = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.shard_size
        self.vocab_end = min(num_embeddings, self.vocab_start + self.shard_size)
        self.weight = nn.Parameter(
            torch.zeros(self.shard_size, embedding_dim, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if loaded.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"{type(self).__name__}: checkpoint tensor has shape {tuple(loaded.shape)}, "
                f"the model expects ({self.num_embeddings}, {self.embedding_dim})"
            )
        rows = loaded[self.vocab_start : self.vocab_end]
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = (input_ids - self.vocab_start) * in_range
        out = F.embedding(local, self.weight)
        return self.tp_group.all_reduce(out * in_range.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """`logits = hidden @ weight^T (+ bias)` over this rank's vocabulary shard."""

    def __init__(self, *args, bias: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._packed: torch.Tensor | None = None
        self.bias = None
        if bias:  # Phi: sharded like the rows, zero on the padding
            self.bias = nn.Parameter(self.weight.new_zeros(self.shard_size), requires_grad=False)
            self.bias.weight_loader = self._bias_loader

    def _bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape != (self.num_embeddings,):
            raise ValueError(
                f"{type(self).__name__}: bias has shape {tuple(loaded.shape)}, the model "
                f"expects ({self.num_embeddings},)"
            )
        rows = loaded[self.vocab_start : self.vocab_end]
        param.data[: rows.shape[0]].copy_(rows)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding table (tie_word_embeddings)."""
        self.weight = embedding.weight

    def prepack(self) -> bool:
        """CPU: keep a oneDNN-packed copy of the table for the matmul (see layers.linear)."""
        weight = self.weight
        if weight.device.type != "cpu" or not can_prepack(weight.dtype):
            return False
        try:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        except RuntimeError as e:
            logger.debug("oneDNN weight prepack unavailable (%s)", e)
            return False
        return True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            logits = torch.ops.mkldnn._linear_pointwise(
                hidden, self._packed, self.bias, "none", [], ""
            )
        else:
            logits = F.linear(hidden, self.weight, self.bias)
        if self.tp_size == 1:
            return logits[..., : self.num_embeddings]
        return self.tp_group.all_gather(logits, dim=-1)[..., : self.num_embeddings]
