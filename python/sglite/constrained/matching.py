"""Scheduler-side matching: a batch's constrained rows, and each sampled token through its matcher.

Invariant: a constrained request's matcher has accepted exactly its processed output tokens,
`req.grammar.num_accepted == len(req.output_ids)`. Tokens are accepted when a result is
processed (`accept_token`); results of an older epoch (a retracted request) are dropped
unprocessed, and a retracted request keeps its output, so nothing accepted is ever discarded
today. `grammar_rows` still enforces the invariant before each mask is built: it rolls back any
accepted token that is no longer in the output.

The overlap loop must not build a constrained row before the row's previous token is processed
(the matcher would lag one token behind): the scheduler processes a pending batch that has
constrained rows (`GrammarRows` given to the worker) before it builds the next batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglite.constrained.base import Grammar
    from sglite.scheduler.req import Req

logger = logging.getLogger(__name__)


@dataclass
class GrammarRows:
    """The constrained sampling rows of one batch: what the worker needs to build their
    token mask (sglite.constrained.mask.fill_vocab_mask)."""

    batch_size: int
    row_idx: list[int]
    grammars: list[Grammar]


def grammar_rows(reqs: Sequence[Req], sample_mask: Sequence[bool]) -> GrammarRows | None:
    """The rows of `reqs` that sample under a grammar (None when there are none), with each
    matcher brought back to its request's output first (see the module docstring)."""
    if all(r.grammar is None for r in reqs):
        return None
    idx: list[int] = []
    grammars: list[Grammar] = []
    for i, (req, samples) in enumerate(zip(reqs, sample_mask)):
        g = req.grammar
        if g is None or not samples:
            continue
        extra = g.num_accepted - len(req.output_ids)
        if extra > 0:
            g.rollback(extra)
        idx.append(i)
        grammars.append(g)
    return GrammarRows(len(reqs), idx, grammars) if idx else None


def accept_token(req: Req, token: int) -> dict[str, Any] | None:
    """Advance req's matcher by its newest output token (`token`); the finish reason the
    grammar gives: `{"type": "stop", "matched": token}` once it accepted its stop token (EOS),
    `{"type": "stop", "matched": None}` when it refuses the token (which is then dropped from
    the output; the mask makes this impossible unless it allowed nothing)."""
    g = req.grammar
    if not g.accept(token):
        logger.warning("request %s: token %d is not allowed by its grammar", req.rid, token)
        req.output_ids.pop()
        return {"type": "stop", "matched": None}
    if g.is_terminated:
        return {"type": "stop", "matched": token}
    return None
