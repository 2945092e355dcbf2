"""Req: one generation request inside the scheduler, and its stop conditions.

Who owns which part of a request's KV row (`row`, a ReqToTokenPool row):

    positions [0, cached_len)           tree-owned slots; the path to `lock_node` is locked
    positions [cached_len, alloc_len)   slots this request allocated and must free
    positions [0, kv_len)               hold computed KV (or KV being computed by a launched batch)

`cached_len` is page-aligned. `kv_len <= alloc_len`; in the overlap loop `alloc_len` may run one
token ahead of what result processing has seen. The token at position p is fill[p],
where fill = prompt + processed output (`fill_slice`); decode rows whose input token is still being
sampled by the in-flight batch use a future reference instead (see scheduler/worker.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglite.logprobs import LogprobOptions, RowLogprobs, TokenLogprob
from sglite.sampling_params import SamplingParams

STOP_STRING_TAIL_TOKENS = 8  # extra tokens decoded beyond the longest stop string's length


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    extra_key: str | None = None
    logprob: LogprobOptions | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # --enable-priority-scheduling (scheduler/priority.py)

    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict[str, Any] | None = None

    # KV bookkeeping (see the module docstring)
    row: int | None = None
    cached_len: int = 0
    lock_node: int | None = None
    kv_len: int = 0
    alloc_len: int = 0
    # slots it gave up (duplicates of the tree's) while a launched batch may still read
    # them; they reach the allocator once that batch is processed (CacheManager.checkpoint)
    stale_slots: list = field(default_factory=list)
    # prefix matched by the last match (not yet locked by admission)
    match_len: int = 0
    match_node: int = 0
    match_slots: Any = None
    match_version: tuple[int, int] | None = None  # (cache version, fill_len) of that match
    # HiCache: the host-only continuation of that match (loaded back at admission)
    host_hit_len: int = 0
    host_node: int = 0
    host_slots: Any = None
    storage_hashes: list[str] = field(default_factory=list)  # file tier: page hash chain
    loaded_host_len: int = 0  # tokens its admissions loaded from the host / file tier
    loaded_storage_len: int = 0
    # scheduling
    bypassers: list = field(default_factory=list)  # admitted past it while it waited (admission.py)
    num_retractions: int = 0
    epoch: int = 0  # bumped on retraction: in-flight results of an older epoch are dropped
    scheduled_outputs: int = 0  # output tokens scheduled (processed or in flight)
    in_flight: int = 0  # launched batches holding this request whose result is unprocessed
    cached_tokens: int = 0  # prompt tokens served from the cache, reported to the client
    # streaming
    sent_len: int = 0
    first_output_sent: bool = False
    finish_sent: bool = False
    wait_since_processed: int = 0  # processed-token counter at arrival (HRRN aging)
    # log-probs (see sglite/logprobs.py): prompt positions [input_logprob_next, prompt_len)
    # still need theirs; entries not yet streamed start at the sent_* counters
    input_logprobs: list[TokenLogprob] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    input_logprob_next: int = 0
    sent_input_logprobs: int = 0
    sent_output_logprobs: int = 0
    # structured output: the matcher (sglite.constrained), set once the grammar compiled
    grammar: Any = None

    def __post_init__(self) -> None:
        # the prompt as one int64 array: the tree core and the forward read it without copies
        self.input_arr = np.asarray(self.input_ids, dtype=np.int64)
        n = len(self.input_ids)
        self.input_logprob_next = n if self.logprob is None else self.logprob.input_start(n)
        if self.input_logprob_next == 0:  # the first token has no log-prob, only its id
            self.input_logprobs.append(TokenLogprob(self.input_ids[0], None))
            self.input_logprob_next = 1

    def fill_slice(self, start: int, end: int) -> np.ndarray:
        """fill_ids[start:end] as int64 (a view while it stays inside the prompt)."""
        n = len(self.input_ids)
        if end <= n:
            return self.input_arr[start:end]
        out = np.asarray(self.output_ids[max(start - n, 0) : end - n], dtype=np.int64)
        return out if start >= n else np.concatenate([self.input_arr[start:], out])

    @property
    def fill_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def match_limit(self) -> int:
        """The longest prefix the cache may serve: one token is always computed, and prompt
        log-probs still to compute need the logits of the position before each."""
        if self.input_logprob_next < len(self.input_ids):
            return self.input_logprob_next - 1
        return self.fill_len - 1

    @property
    def hit_len(self) -> int:
        """What the cache can serve: the device match and its host continuation (HiCache),
        which prefix-aware policies rank by (as SGLang's num_matched_prefix_tokens)."""
        return self.match_len + self.host_hit_len

    @property
    def max_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def has_kv(self) -> bool:
        return self.row is not None

    @property
    def remaining_new_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    @property
    def finishing_in_flight(self) -> bool:
        """All of its tokens are scheduled: it will finish by length when results land."""
        return self.scheduled_outputs >= self.max_new_tokens

    def add_input_logprobs(self, row: RowLogprobs | None) -> None:
        """Prompt log-probs a batch computed (they continue at `input_logprob_next`)."""
        if row is not None and row.input:
            self.input_logprobs += row.input
            self.input_logprob_next += len(row.input)

    def add_output_logprob(self, row: RowLogprobs | None) -> None:
        """The log-prob of the output token just appended."""
        if row is not None and row.output is not None:
            self.output_logprobs.append(row.output)

    def reset_for_retract(self) -> None:
        self.row = None
        self.cached_len = self.kv_len = self.alloc_len = 0
        self.lock_node = None
        self.match_len, self.match_node, self.match_slots = 0, 0, None
        self.match_version = None
        self.host_hit_len, self.host_node, self.host_slots = 0, 0, None
        self.scheduled_outputs = len(self.output_ids)
        self.num_retractions += 1
        self.epoch += 1


class StopChecker:
    """Finish conditions, checked after each appended token (SGLang's order; an abort
    finishes the request at once, in Scheduler.abort)."""

    def __init__(self, eos_token_ids: set[int], decode_tail):
        self.eos_token_ids = eos_token_ids
        self.decode_tail = decode_tail  # callable(list[int]) -> str, for stop strings

    def check(self, req: Req) -> dict[str, Any] | None:
        sp = req.sampling_params
        out = req.output_ids
        last = out[-1]
        past_min = len(out) >= sp.min_new_tokens
        stops = sp.stop_strs
        if past_min and stops:
            longest = max(len(s) for s in stops)
            tail = self.decode_tail(out[-(longest + STOP_STRING_TAIL_TOKENS) :])
            for stop in stops:
                if stop and stop in tail:
                    return {"type": "stop", "matched": stop}
        if past_min:
            if sp.stop_token_ids and last in sp.stop_token_ids:
                return {"type": "stop", "matched": last}
            if not sp.ignore_eos and last in self.eos_token_ids:
                return {"type": "stop", "matched": last}
        if len(out) >= sp.max_new_tokens:
            return {"type": "length", "length": sp.max_new_tokens}
        return None
