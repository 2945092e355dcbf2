"""From the last hidden states of a forward to float32 logits: pick the rows, apply the LM head."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from sglite.layers.vocab_parallel_embedding import ParallelLMHead
    from sglite.model_executor.forward_batch import ForwardBatch


class LogitsProcessor(nn.Module):
    """Extend batches keep the last token of each request (or all of them with
    `batch.return_all_logits`, or the rows `batch.logits_index` names: prompt log-probs);
    decode batches have exactly one token per request.

    The float32 logits are then multiplied by `scale` (Cohere's `logit_scale`, Granite's
    `1 / logits_scaling`) and, with `softcap`, squashed to `softcap * tanh(logits / softcap)`
    (Gemma 2's `final_logit_softcapping`)."""

    def __init__(self, scale: float = 1.0, softcap: float | None = None) -> None:
        super().__init__()
        self.scale, self.softcap = scale, softcap

    def forward(
        self, hidden: torch.Tensor, lm_head: ParallelLMHead, batch: ForwardBatch
    ) -> torch.Tensor:
        if batch.logits_index is not None:
            hidden = hidden.index_select(0, batch.logits_index)
        elif batch.forward_mode.is_extend() and not batch.return_all_logits:
            lens = batch.extend_seq_lens_cpu
            if len(lens) != hidden.shape[0] or max(lens) != 1:
                # on the device already: no blocking host-to-device copy in the forward
                last = torch.cumsum(batch.extend_seq_lens, 0) - 1
                hidden = hidden.index_select(0, last)
        logits = lm_head(hidden).float()
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
