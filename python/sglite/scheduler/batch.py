"""ScheduleBatch: the requests of one step, and ForwardInput: what the model worker receives.

A batch is a list of rows; row i computes positions [starts[i], ends[i]) of request i.
Prefill rows (possibly a chunk of a prompt) and decode rows (one position) can mix
(`--enable-mixed-chunk`); the mode says which kind of forward runs.

Decode rows whose input token is still being sampled by the in-flight batch (overlap loop)
carry a future reference `-(future_slot + 1)` instead of the token id; the worker resolves it
from its future buffer, where every launched batch stores its sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from sglite.constrained.matching import GrammarRows, grammar_rows
from sglite.logprobs import RowLogprobSpec
from sglite.sampling_params import SamplingParams
from sglite.scheduler.req import Req


class Mode(StrEnum):
    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"


@dataclass
class ForwardInput:
    """Plain arrays and params of one forward; built on the scheduler side, run by a worker."""

    mode: Mode
    rids: list[str]
    rows: np.ndarray  # request rows (ReqToTokenPool)
    prefix_lens: np.ndarray  # positions already cached before this step
    seq_lens: np.ndarray  # positions after this step
    prompt_lens: np.ndarray  # seq_lens - prompt_lens = output tokens before this step's one
    input_ids: np.ndarray  # flat; negative = future reference
    out_cache_loc: np.ndarray  # flat KV slots of the computed positions
    sampling_params: list[SamplingParams]
    future_slots: np.ndarray  # where each row's sampled token is stored
    # penalty context, only for rows that use penalties (else None): prompt and output ids
    penalty_tokens: list[tuple[list[int], list[int]] | None]
    table_rows: np.ndarray | None = None  # row contents to copy when the table is mirrored
    # per row, the log-probs to compute (None: none); empty when no row asks
    logprob_specs: list[RowLogprobSpec | None] = field(default_factory=list)
    vocab_mask: GrammarRows | None = None  # constrained rows: their matchers give the token mask

    @property
    def batch_size(self) -> int:
        return len(self.rows)


@dataclass
class ScheduleBatch:
    reqs: list[Req]
    starts: list[int]
    ends: list[int]
    is_decode: list[bool]
    epochs: list[int] = field(default_factory=list)
    future_slots: np.ndarray | None = None
    out_cache_loc: np.ndarray | None = None
    has_grammar: bool = False  # launched with constrained rows (set by Scheduler.launch)

    sample_mask: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.epochs:
            self.epochs = [r.epoch for r in self.reqs]
        self.refresh_sample_mask()

    def refresh_sample_mask(self) -> None:
        """Which rows yield an output token (a middle chunk does not); fixed at creation."""
        self.sample_mask = [
            dec or end >= r.fill_len for r, end, dec in zip(self.reqs, self.ends, self.is_decode)
        ]

    @property
    def mode(self) -> Mode:
        if all(self.is_decode):
            return Mode.DECODE
        return Mode.MIXED if any(self.is_decode) else Mode.EXTEND

    @property
    def is_extend(self) -> bool:
        return self.mode != Mode.DECODE

    @property
    def num_tokens(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends))

    def describe(self) -> str:
        """For logs and the watchdog: `decode batch of 12 requests, 12 tokens`."""
        return f"{self.mode.value} batch of {len(self.reqs)} requests, {self.num_tokens} tokens"

    def forward_input(self, future_of: dict[int, int]) -> ForwardInput:
        """What the worker runs (future_slots must be set; `future_of` as in input_ids)."""
        reqs = self.reqs
        n = len(reqs)
        rows, prompt_lens, params, rids = [0] * n, [0] * n, [None] * n, [""] * n
        penalty: list = [None] * n
        specs: list[RowLogprobSpec | None] = [None] * n
        for i, req in enumerate(reqs):
            sp = req.sampling_params
            rows[i], prompt_lens[i], params[i], rids[i] = req.row, len(req.input_ids), sp, req.rid
            if sp.frequency_penalty or sp.presence_penalty or sp.repetition_penalty != 1.0:
                penalty[i] = (req.input_ids, list(req.output_ids))
            if req.logprob is not None:
                specs[i] = self._logprob_spec(i)
        return ForwardInput(
            mode=self.mode,
            rids=rids,
            rows=np.asarray(rows, dtype=np.int64),
            prefix_lens=np.asarray(self.starts, dtype=np.int64),
            seq_lens=np.asarray(self.ends, dtype=np.int64),
            prompt_lens=np.asarray(prompt_lens, dtype=np.int64),
            input_ids=self.input_ids(future_of),
            out_cache_loc=self.out_cache_loc,
            sampling_params=params,
            future_slots=self.future_slots,
            penalty_tokens=penalty,
            vocab_mask=grammar_rows(reqs, self.sample_mask),
            logprob_specs=specs if any(s is not None for s in specs) else [],
        )

    def _logprob_spec(self, i: int) -> RowLogprobSpec:
        """Row i's share of its request's log-probs: the sampled token's (when the row
        samples), and the prompt positions of this chunk still waiting for theirs (prompt
        token p's log-prob is read at the logits of position p - 1)."""
        req, start, end = self.reqs[i], self.starts[i], self.ends[i]
        opts = req.logprob
        first = max(req.input_logprob_next - 1, start)
        last = min(end, len(req.input_ids) - 1)  # exclusive: position of the prompt's last token
        targets = None
        if not self.is_decode[i] and last > first:
            targets = req.fill_slice(first + 1, last + 1)
        return RowLogprobSpec(
            opts.top_logprobs_num,
            opts.token_ids_logprob,
            self.sample_mask[i],
            first,
            targets,
        )

    def input_ids(self, future_of: dict[int, int]) -> np.ndarray:
        """Flat input ids; decode rows whose input is in flight get a future reference."""
        parts: list = []
        for req, s, e, dec in zip(self.reqs, self.starts, self.ends, self.is_decode):
            if not dec:
                parts.append(req.fill_slice(s, e))
            elif id(req) in future_of:
                parts.append(-(future_of[id(req)] + 1))
            else:  # the newest token of the request
                parts.append(req.output_ids[-1] if req.output_ids else req.input_ids[-1])
        if all(self.is_decode):
            return np.asarray(parts, dtype=np.int64)
        return np.concatenate([np.atleast_1d(np.asarray(p, dtype=np.int64)) for p in parts])
