"""PrefillManager: forms the next prefill batch from the waiting queue (and the chunked request).

Gates run before any prefix math: free request rows (and --max-running-requests), then a
min-free-slots delay that postpones admission while the running batch has almost no KV
headroom left (admitting now would only force a retraction; bounded so nothing starves).
Then the policy sorts the queue, the PrefillAdder charges candidates, rows and slots are
allocated, and the chunked request (if any) continues first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglite.scheduler.batch import ScheduleBatch
from sglite.scheduler.prefill_adder import PrefillAdder

if TYPE_CHECKING:
    from sglite.scheduler.scheduler import Scheduler

MIN_FREE_PAGES_PER_RUNNING_REQ = 2
MAX_DELAYED_PASSES = 8


class PrefillManager:
    def __init__(self, sched: Scheduler):
        self.s = sched
        self.chunked_req = None
        self.num_delayed = 0

    def get_new_batch(self) -> ScheduleBatch | None:
        s = self.s
        chunked = self.chunked_req
        if chunked is not None:  # its previous slice is computed or in flight: publish it
            s.cache.checkpoint(chunked, chunked.kv_len)
        if not s.waiting and chunked is None:
            return None
        running = [r for r in s.running if not r.finished]
        free_rows = min(
            s.max_running - len(running) - (chunked is not None),
            s.cache.req_to_token_pool.available_size(),
        )
        if chunked is None and (free_rows <= 0 or self._should_delay(running)):
            return None

        s.policy.sort(s.waiting, s.processed_tokens)
        args = s.args
        mixed = bool(args.enable_mixed_chunk and args.chunking_enabled and running)
        adder = PrefillAdder(
            s.core,
            s.cache,
            running,
            s.decode.ratio.value,
            args.max_prefill_tokens,
            args.chunked_prefill_size if args.chunking_enabled else None,
            len(running) if mixed else 0,
        )
        if chunked is not None:
            adder.add_chunked(chunked)
        verdict = s.core.AddReqResult.CONTINUE
        for req in s.waiting:
            if (
                verdict != s.core.AddReqResult.CONTINUE
                or len(adder.entries) - (chunked is not None) >= free_rows
            ):
                break
            before = len(adder.entries)
            verdict = adder.add_one(req)
            if len(adder.entries) == before:
                break
        if not adder.entries:
            return None
        return self._build(adder, running if mixed else [])

    def _build(self, adder: PrefillAdder, decode_reqs: list) -> ScheduleBatch | None:
        s = self.s
        entries = adder.entries
        reqs = [e.req for e in entries]
        if not s.cache.alloc_rows(reqs):
            adder.rollback()
            return None
        starts = [e.start for e in entries]
        ends = [e.end for e in entries]
        slots = s.cache.alloc_extend(reqs, starts, ends)
        if slots is None:  # the budget said it fits; eviction could not make room
            for e in entries:
                if e.req is not self.chunked_req:
                    s.cache.release(e.req, insert=False)
            return None
        admitted = {id(r) for r in reqs}
        s.waiting = [r for r in s.waiting if id(r) not in admitted]
        for e in entries:
            req = e.req
            if req is not self.chunked_req:  # first slice of a (re-)admitted request
                if req.num_retractions == 0:
                    req.cached_tokens = e.start
                    s.counters["num_prompt_tokens_total"] += len(req.input_ids)
                    s.counters["num_cached_tokens_total"] += e.start
            req.kv_len = e.end
            if not e.is_last_chunk:
                s.counters["num_chunks"] += 1
        self.chunked_req = adder.new_chunked_req
        batch = ScheduleBatch(reqs, starts, ends, [False] * len(reqs), out_cache_loc=slots)
        if decode_reqs:
            s.decode.mix_into(batch, decode_reqs)
        for e in entries:
            if e.is_last_chunk:
                s.running.append(e.req)
        return batch

    def _should_delay(self, running: list) -> bool:
        if not running:
            self.num_delayed = 0
            return False
        cache = self.s.cache
        need = MIN_FREE_PAGES_PER_RUNNING_REQ * cache.page_size * len(running)
        if cache.available_and_evictable() < need and self.num_delayed < MAX_DELAYED_PASSES:
            self.num_delayed += 1
            return True
        self.num_delayed = 0
        return False
