"""PrefillManager: forms the next prefill batch from the waiting queue (and the chunked request).

Gates run before any prefix math: free request rows (and --max-running-requests), then a
min-free-slots delay that postpones admission while the running batch has almost no KV
headroom left (admitting now would only force a retraction; bounded so nothing starves).
Then the policy sorts the queue, the PrefillAdder charges candidates, rows and slots are
allocated, and the chunked request (if any) continues first. A candidate refused for memory
does not end the pass, nor does a budget spent by its estimate: smaller ones behind it may
still fit, and one whose whole life fits in memory free now is admitted even so, on the terms
of admission.py (bounded lookahead; nothing passes it once it would fit without those that did).
"""

from __future__ import annotations

from typing import Any

from sglite.config import ServerArgs
from sglite.mem_cache.cache_manager import CacheManager
from sglite.scheduler.admission import HeadOfLineGuard
from sglite.scheduler.batch import ScheduleBatch
from sglite.scheduler.decode import DecodeManager
from sglite.scheduler.policy import BatchPrefixGate, SchedulePolicy
from sglite.scheduler.prefill_adder import PrefillAdder
from sglite.scheduler.prefill_delayer import (
    DEFAULT_MAX_DELAY_MS,
    DelayerConfig,
    NoDelayer,
    PrefillDelayer,
)
from sglite.scheduler.req import Req

MIN_FREE_PAGES_PER_RUNNING_REQ = 2
MAX_DELAYED_PASSES = 8


class PrefillManager:
    """Owns the request being chunked; `counters` is the scheduler's (updated in place)."""

    def __init__(
        self,
        args: ServerArgs,
        core: Any,
        cache: CacheManager,
        policy: SchedulePolicy,
        decode: DecodeManager,
        max_running: int,
        counters: dict[str, int],
        agree: Any = None,
    ):
        self.args = args
        self.core = core
        self.cache = cache
        self.policy = policy
        self.decode = decode
        self.max_running = max_running
        self.counters = counters
        self.chunked_req: Req | None = None
        self.num_delayed = 0
        self.guard = HeadOfLineGuard(args.prefill_lookahead_requests, args.page_size)
        counters.setdefault("num_bypassing_reqs", 0)  # admitted past one refused for memory
        counters.setdefault("num_whole_life_reqs", 0)  # admitted by the whole-life rule
        self.sizer = None  # ChunkSizer (--enable-dynamic-chunking), set once profiled
        self.delayer = NoDelayer()
        if args.enable_prefill_delayer:
            cfg = DelayerConfig(
                max_running_requests=max_running,
                max_delay_passes=args.prefill_delayer_max_delay_passes,
                token_usage_low_watermark=args.prefill_delayer_token_usage_low_watermark,
                queue_min_ratio=args.prefill_delayer_queue_min_ratio,
                max_delay_ms=args.prefill_delayer_max_delay_ms or DEFAULT_MAX_DELAY_MS,
            )
            self.delayer = PrefillDelayer(cfg, counters, agree=agree)

    def get_new_batch(
        self, waiting: list[Req], running: list[Req], processed_tokens: int
    ) -> ScheduleBatch | None:
        """The next prefill batch. Admitted requests leave `waiting` and those whose prompt
        is complete join `running` (both lists are changed in place). One prefill-delayer
        decision per call."""
        live = [r for r in running if not r.finished]
        capacity = self.cache.allocator.capacity()
        usage = 1 - self.cache.available_and_evictable() / capacity
        self.delayer.start(usage, len(live), len(waiting))
        before = self.chunked_req
        batch = self._get_new_batch(waiting, running, processed_tokens)
        num_new = 0
        if batch is not None:
            num_new = sum(not d and r is not before for r, d in zip(batch.reqs, batch.is_decode))
        self.delayer.finish(num_new)
        return batch

    def _get_new_batch(
        self, waiting: list[Req], running: list[Req], processed_tokens: int
    ) -> ScheduleBatch | None:
        chunked = self.chunked_req
        if chunked is not None:  # its previous slice is computed or in flight: publish it
            self.cache.checkpoint(chunked, chunked.kv_len)
        if not waiting and chunked is None:
            return None
        live = [r for r in running if not r.finished]
        free_rows = min(
            self.max_running - len(live) - (chunked is not None),
            self.cache.req_to_token_pool.available_size(),
        )
        if chunked is None and (
            free_rows <= 0 or self._too_few_free_slots(live, free_rows) or self._should_delay(live)
        ):
            return None

        self.policy.sort(waiting, processed_tokens)
        args = self.args
        mixed = bool(args.enable_mixed_chunk and args.chunking_enabled and live)
        adder = PrefillAdder(
            self.core,
            self.cache,
            live,
            self.decode.ratio.value,
            args.max_prefill_tokens,
            self._chunk_size(chunked),
            len(live) if mixed else 0,
            whole_life=args.prefill_lookahead_requests > 0,
        )
        gate = BatchPrefixGate(self.core, self.cache.enabled)
        if chunked is not None:
            adder.add_chunked(chunked)
            gate.add(chunked)
            self.delayer.allows()  # a request mid-chunk always proceeds; the verdict holds
            # for the new ones
        self._admit_waiting(adder, gate, waiting, free_rows + (chunked is not None))
        if not adder.entries:
            return None
        batch = self._build(adder, waiting)
        if batch is not None:
            self.counters["num_bypassing_reqs"] += self.guard.commit()
            self.counters["num_whole_life_reqs"] += adder.num_whole_life
            for e in adder.entries:
                e.req.bypassers = []
            if mixed:
                self.decode.mix_into(batch, live)
            running += [e.req for e in adder.entries if e.is_last_chunk]
        return batch

    def _admit_waiting(
        self, adder: PrefillAdder, gate: BatchPrefixGate, waiting: list[Req], max_entries: int
    ) -> None:
        NO_TOKEN, OTHER = self.core.AddReqResult.NO_TOKEN, self.core.AddReqResult.OTHER
        guard = self.guard
        guard.start()
        # Memory spent by the budget's estimate ends SGLang's pass (lookahead 0); otherwise a
        # candidate may still be admitted by the whole-life rule (admission.py).
        stop_on_no_token = guard.max_lookahead == 0
        verdict = self.core.AddReqResult.CONTINUE
        for req in waiting:
            if verdict == OTHER or (verdict == NO_TOKEN and stop_on_no_token):
                break
            if len(adder.entries) >= max_entries or not guard.may_try():
                break
            self.cache.match(req)  # current for the gate and the adder (reused if unchanged)
            if gate.defers(req):
                continue
            before = len(adder.entries)
            verdict = adder.add_one(req)
            if len(adder.entries) > before and not self.delayer.allows():
                adder.undo_last()  # the delayer holds new prefills back this pass
                break
            if len(adder.entries) > before:
                gate.add(req)
                guard.admitted(req)
            elif verdict == NO_TOKEN:  # refused for memory: a smaller one may still fit
                guard.refused(req, adder.shortfall)
                verdict = adder.budget.state(self.cache.available_and_evictable())
            else:
                break

    def _build(self, adder: PrefillAdder, waiting: list[Req]) -> ScheduleBatch | None:
        entries = adder.entries
        reqs = [e.req for e in entries]
        if not self.cache.alloc_rows(reqs):
            adder.rollback()
            return None
        starts = [e.start for e in entries]
        ends = [e.end for e in entries]
        slots = self.cache.alloc_extend(reqs, starts, ends)
        if slots is None:  # the budget said it fits; eviction could not make room
            for e in entries:
                if e.req is not self.chunked_req:
                    self.cache.release(e.req, insert=False)
            return None
        admitted = {id(r) for r in reqs}
        waiting[:] = [r for r in waiting if id(r) not in admitted]
        for e in entries:
            req = e.req
            if req is not self.chunked_req:  # first slice of a (re-)admitted request
                if req.num_retractions == 0:
                    req.cached_tokens = e.start
                    self.counters["num_prompt_tokens_total"] += len(req.input_ids)
                    self.counters["num_cached_tokens_total"] += e.start
                    self.cache.tier.count_hits(req, e.start)
            req.kv_len = e.end
            if not e.is_last_chunk:
                self.counters["num_chunks"] += 1
        self.chunked_req = adder.new_chunked_req
        return ScheduleBatch(reqs, starts, ends, [False] * len(reqs), out_cache_loc=slots)

    def _chunk_size(self, chunked: Req | None) -> int | None:
        """This pass's chunk budget: the dynamic sizer's for a continuation, else the flag's."""
        args = self.args
        if not args.chunking_enabled:
            return None
        if chunked is not None and self.sizer is not None:
            return self.sizer.predict(chunked.kv_len) or args.chunked_prefill_size
        return args.chunked_prefill_size

    def _too_few_free_slots(self, running: list, free_rows: int) -> bool:
        """--min-free-slots-delay N: wait for min(N, max running) free slots while requests run
        (no time bound: running requests finish and free theirs)."""
        n = self.args.min_free_slots_delay
        threshold = min(n, self.max_running) if n is not None else 0
        return threshold > 1 and bool(running) and free_rows < threshold

    def _should_delay(self, running: list) -> bool:
        if not running:
            self.num_delayed = 0
            return False
        cache = self.cache
        need = MIN_FREE_PAGES_PER_RUNNING_REQ * cache.page_size * len(running)
        if cache.available_and_evictable() < need and self.num_delayed < MAX_DELAYED_PASSES:
            self.num_delayed += 1
            return True
        self.num_delayed = 0
        return False
