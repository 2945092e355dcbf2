"""ResultProcessor: a launched batch's sampled tokens applied to its requests, and finishing.

Per row whose request is alive and of the batch's epoch (a retraction bumps the epoch; the
older results are dropped): record the prompt log-probs it computed; if the row samples,
append its token (dropped for max_new_tokens 0) and its log-prob, run the grammar and stop
checks, finish or publish the prompt right after its prefill. Finishing frees the request's
KV at once, or, while a launched batch still reads its row (`req.in_flight > 0`, the overlap
loop), once that batch's result is processed (`releasing`; see scheduler.py's docstring).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sglite.constrained.matching import accept_token
from sglite.logprobs import RowLogprobs
from sglite.scheduler.batch import ScheduleBatch
from sglite.scheduler.req import Req, StopChecker


class ResultProcessor:
    def __init__(self, cache, client, stop_checker: StopChecker, streamer, counters: dict):
        self.cache = cache
        self.client = client
        self.stop_checker = stop_checker
        self.streamer = streamer
        self.counters = counters
        self.future_of: dict[int, int] = {}  # id(req) -> future slot of its in-flight token
        # finished requests whose KV a launched batch still reads: id -> (req, insert)
        self.releasing: dict[int, tuple[Req, bool]] = {}

    def process(
        self,
        batch: ScheduleBatch,
        tokens: np.ndarray,
        logprobs: list[RowLogprobs | None] | None = None,
    ) -> None:
        """Apply the batch's tokens, stream the requests that got one, release KV that only
        this batch still read."""
        alloc = self.cache.allocator
        alloc.free_group_begin()
        touched: list[Req] = []
        try:
            slots = batch.future_slots.tolist()
            toks = tokens.tolist()
            for i, req in enumerate(batch.reqs):
                req.in_flight -= 1
                if req.epoch != batch.epochs[i] or req.finished:
                    continue
                row_logprobs = logprobs[i] if logprobs else None
                req.add_input_logprobs(row_logprobs)
                if not batch.sample_mask[i]:
                    continue
                if self.future_of.get(id(req)) == slots[i]:
                    del self.future_of[id(req)]
                touched.append(req)
                if self._append_token(req, toks[i], batch, i):
                    req.add_output_logprob(row_logprobs)
            for req in batch.reqs:  # KV that only this batch still read
                if req.in_flight == 0:
                    if req.stale_slots:
                        self.cache.free_stale(req)
                    if id(req) in self.releasing:
                        self._release(*self.releasing.pop(id(req)))
        finally:
            alloc.free_group_end()
        self.streamer.stream(touched)

    def _append_token(self, req: Req, token: int, batch: ScheduleBatch, i: int) -> bool:
        """Append the sampled token (False: max_new_tokens 0, the token is dropped)."""
        if req.max_new_tokens == 0:
            self.finish(req, {"type": "length", "length": 0})
            return False
        req.output_ids.append(token)
        self.counters["num_generated_tokens_total"] += 1
        reason = accept_token(req, token) if req.grammar is not None else None
        reason = reason or self.stop_checker.check(req)
        if reason is not None:
            self.finish(req, reason)
        elif not batch.is_decode[i]:
            self.cache.checkpoint(req, batch.ends[i])  # publish the prompt right after prefill
        return True

    def finish(self, req: Req, reason: dict[str, Any]) -> None:
        req.finished_reason = reason
        self.future_of.pop(id(req), None)
        if req.has_kv:
            insert = reason.get("type") != "abort"
            if req.in_flight:  # a launched batch still reads its row
                self.releasing[id(req)] = (req, insert)
            else:
                self._release(req, insert)
        key = "num_aborted_reqs" if reason.get("type") == "abort" else "num_finished_reqs"
        self.counters[key] += 1

    def _release(self, req: Req, insert: bool) -> None:
        self.cache.release(req, insert=insert)
        self.client.release([req.rid])
