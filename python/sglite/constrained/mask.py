"""The token mask of a batch's constrained rows: filled by the worker, applied by the sampler.

`fill_vocab_mask(rows, vocab_size, device)` asks each matcher of `rows` (GrammarRows, built by
the scheduler) for its allowed tokens, packed (sglite.constrained.base), and moves the packed
mask to the device (32 times smaller than a boolean one). `apply_vocab_mask(logits, mask)` sets
the logits of the disallowed tokens of those rows to -inf, in place, before penalties,
temperature and greedy argmax. A batch without constrained rows has no mask: neither function
runs for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglite.constrained.matching import GrammarRows

BITS = 32


@dataclass(frozen=True, eq=False)
class VocabMask:
    rows: torch.Tensor  # [n] int64, the constrained rows of the batch
    bitmask: torch.Tensor  # [n, ceil(vocab_size / 32)] int32, packed allowed tokens


def num_words(vocab_size: int) -> int:
    return (vocab_size + BITS - 1) // BITS


def fill_vocab_mask(
    rows: GrammarRows | None, vocab_size: int, device: torch.device | str
) -> VocabMask | None:
    """The packed mask of `rows` on `device`; None when the batch has no constrained row."""
    if rows is None:
        return None
    bitmask = torch.empty((len(rows.row_idx), num_words(vocab_size)), dtype=torch.int32)
    for i, grammar in enumerate(rows.grammars):
        grammar.fill_mask(bitmask, i)
    device = torch.device(device)
    return VocabMask(torch.tensor(rows.row_idx, dtype=torch.int64).to(device), bitmask.to(device))


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[n, words]` packed int32 -> `[n, vocab_size]` bool (True = allowed); ids beyond the
    mask's words are disallowed."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(
        (allowed.shape[0], vocab_size - width), dtype=torch.bool, device=allowed.device
    )
    return torch.cat([allowed, pad], dim=1)


def apply_vocab_mask(logits: torch.Tensor, mask: VocabMask) -> torch.Tensor:
    """Set the disallowed logits of the masked rows to -inf (in place); returns `logits`."""
    allowed = unpack(mask.bitmask, logits.shape[-1])
    rows = logits.index_select(0, mask.rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, mask.rows, rows)
    return logits
