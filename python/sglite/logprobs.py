"""Log-probabilities: what a request asks for, how a batch computes them, what comes back.

Which distribution: the model's raw next-token distribution, `log_softmax(logits)`, before
temperature, penalties, top-k/top-p/min-p and grammar masks (SGLang's and vLLM's default).
So a log-prob does not depend on the sampling parameters, and greedy decoding's token is
the one with the highest log-prob.

Positions. `input_token_logprobs[j]` is the log-prob of prompt token `start + j` given the
tokens before it (`start` = `logprob_start_len`); the prompt's first token has none (None).
Output token i's log-prob comes from the same forward that sampled it. Computing prompt
token p's log-prob needs the logits at position p - 1, so a request that wants prompt
log-probs from `start` must recompute the prompt from `start - 1`: its prefix-cache match is
capped there (see `Req.match_limit`), and the forward computes LM-head rows only for the
positions asked for (`ForwardBatch.logits_index`).

Cost: nothing runs for a batch in which no row asks; rows that ask get a log-softmax over
the vocabulary on the device and only the few numbers asked for go to the host.

Only `compute_logprobs` (the scheduler's) needs torch; it imports it when called, so the
main process and the detokenizer, which use the records here, never load torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs; SGLang has none


@dataclass(frozen=True)
class LogprobOptions:
    """What one request asks for (`return_logprob` true). `logprob_start_len` -1: outputs
    only; `top_logprobs_num`: the k most likely tokens at each position;
    `token_ids_logprob`: the log-probs of these ids at each position."""

    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None
    return_text_in_logprobs: bool = False

    @classmethod
    def from_request(
        cls,
        *,
        logprob_start_len: Any = -1,
        top_logprobs_num: Any = 0,
        token_ids_logprob: Any = None,
        return_text_in_logprobs: Any = False,
        vocab_size: int,
        max_top: int | None = None,
    ) -> LogprobOptions:
        """Validate request fields (ValueError naming the field)."""
        if not _is_int(logprob_start_len) or logprob_start_len < -1:
            raise ValueError(
                f"logprob_start_len must be -1 (outputs only) or a position >= 0, "
                f"got {logprob_start_len!r}"
            )
        top_cap = vocab_size if max_top is None else min(max_top, vocab_size)
        if not _is_int(top_logprobs_num) or not 0 <= top_logprobs_num <= top_cap:
            raise ValueError(
                f"top_logprobs_num must be an integer in [0, {top_cap}], got {top_logprobs_num!r}"
            )
        ids = None
        if token_ids_logprob is not None:
            if not isinstance(token_ids_logprob, (list, tuple)) or not all(
                _is_int(t) and 0 <= t < vocab_size for t in token_ids_logprob
            ):
                raise ValueError(
                    f"token_ids_logprob must be a list of token ids in [0, {vocab_size}), "
                    f"got {token_ids_logprob!r}"
                )
            ids = tuple(token_ids_logprob)
        if not isinstance(return_text_in_logprobs, bool):
            raise ValueError(
                f"return_text_in_logprobs must be true or false, got {return_text_in_logprobs!r}"
            )
        return cls(logprob_start_len, top_logprobs_num, ids, return_text_in_logprobs)

    def input_start(self, prompt_len: int) -> int:
        """First prompt position whose log-prob is returned (prompt_len: none)."""
        return prompt_len if self.logprob_start_len < 0 else self.logprob_start_len


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the log-prob of its token, and the top-k / asked-for ids' log-probs as
    (logprob, token id) pairs (None when not asked)."""

    token_id: int
    logprob: float | None  # None: the prompt's first token
    top: tuple[tuple[float, int], ...] | None = None
    selected: tuple[tuple[float, int], ...] | None = None


@dataclass(frozen=True)
class RowLogprobSpec:
    """What the worker computes for one row of a batch.

    `output`: the log-prob of the token this row samples. `input_pos0` and `input_targets`:
    log-probs of `input_targets[j]` at the logits of position `input_pos0 + j` (prompt
    tokens of this chunk whose log-prob is asked for; their positions lie in the row's
    [start, end))."""

    top_k: int
    token_ids: tuple[int, ...] | None
    output: bool
    input_pos0: int = 0
    input_targets: np.ndarray | None = None

    @property
    def num_input(self) -> int:
        return 0 if self.input_targets is None else len(self.input_targets)


@dataclass
class RowLogprobs:
    """The worker's answer for one row."""

    input: list[TokenLogprob]
    output: TokenLogprob | None


def logits_rows(
    specs: Sequence[RowLogprobSpec | None], starts: Sequence[int], ends: Sequence[int]
) -> np.ndarray | None:
    """Rows of the forward's hidden states to turn into logits when some row asks for prompt
    log-probs: first each row's last token (sampling), then the asked-for positions, row by
    row. None when no row asks (the usual last-token-only path)."""
    if not any(s is not None and s.num_input for s in specs):
        return None
    lens = np.asarray(ends, dtype=np.int64) - np.asarray(starts, dtype=np.int64)
    offsets = np.cumsum(lens) - lens
    extra = [
        offsets[i] + (s.input_pos0 - starts[i]) + np.arange(s.num_input)
        for i, s in enumerate(specs)
        if s is not None and s.num_input
    ]
    return np.concatenate([offsets + lens - 1, *extra]).astype(np.int64)


def compute_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    specs: Sequence[RowLogprobSpec | None],
) -> list[RowLogprobs | None]:
    """Log-probs of a batch from its raw logits. `logits` has one row per request (the
    sampling rows) followed by the prompt rows of `logits_rows`, in that order; `tokens`
    are the sampled tokens `[B]`."""
    import torch  # here, not at the top: the main process and the detokenizer import this

    bs = len(specs)
    out_rows = [i for i, s in enumerate(specs) if s is not None and s.output]
    rows: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    owners: list[tuple[int, str, int]] = []  # (request row, "in"/"out", count)
    if out_rows:
        idx = torch.tensor(out_rows, dtype=torch.int64, device=logits.device)
        rows.append(logits.index_select(0, idx))
        targets.append(tokens.index_select(0, idx))
        owners += [(i, "out", 1) for i in out_rows]
    base = bs
    for i, s in enumerate(specs):
        if s is not None and s.num_input:
            rows.append(logits[base : base + s.num_input])
            targets.append(torch.from_numpy(s.input_targets).to(logits.device))
            owners.append((i, "in", s.num_input))
            base += s.num_input
    results: list[RowLogprobs | None] = [
        RowLogprobs([], None) if s is not None else None for s in specs
    ]
    if not rows:
        return results
    logprobs = torch.log_softmax(torch.cat(rows).float(), dim=-1)
    picked = logprobs.gather(1, torch.cat(targets).view(-1, 1)).view(-1)
    asking = [specs[i] for i in {o[0] for o in owners}]
    k = max(spec.top_k for spec in asking)
    top_vals = top_ids = None
    if k:
        top = logprobs.topk(k, dim=-1)
        top_vals, top_ids = top.values.cpu().tolist(), top.indices.cpu().tolist()
    id_sets = {spec.token_ids for spec in asking} - {None}
    selected_vals = {ids: logprobs[:, list(ids)].cpu().tolist() for ids in id_sets}
    picked_l = picked.cpu().tolist()
    target_l = torch.cat(targets).cpu().tolist()
    j = 0
    for i, kind, count in owners:
        spec = specs[i]
        entries = []
        for _ in range(count):
            top_j = None
            if spec.top_k:
                top_j = tuple(zip(top_vals[j][: spec.top_k], top_ids[j][: spec.top_k]))
            sel_j = None
            if spec.token_ids is not None:
                sel_j = tuple(zip(selected_vals[spec.token_ids][j], spec.token_ids))
            entries.append(TokenLogprob(int(target_l[j]), picked_l[j], top_j, sel_j))
            j += 1
        if kind == "out":
            results[i].output = entries[0]
        else:
            results[i].input = entries
    return results
