"""Scheduler: the loop that picks the next batch, runs it and processes its results.

Each tick: receive messages -> pick the next batch (prefill first, else decode) -> run it ->
process its results; a step ends by publishing the tree's changes (KV events, when on).
`step_normal` runs each batch to completion before the next; `step_overlap` launches batch
N+1 before processing the result of batch N (results one step late; finished requests are
never streamed twice nor decoded again). Admission lives in prefill.py, decode memory and
retraction in decode.py, result processing and finishing in results.py, streaming in
output.py. Constrained requests wait in `grammars` for their grammar (sglite.constrained);
the overlap loop processes a launched batch with constrained rows before it builds the next.

Lifetime of a request's KV in the overlap loop: a launched batch reads its requests' rows of
the request table (on CPU the very table the scheduler writes) until its result is processed.
So a request that finishes (or is aborted) while a launched batch still holds it
(`req.in_flight > 0`) keeps its row, slots and tree lock until that batch's result is
processed (`releasing`); only then is its KV published and freed. Duplicate prefix slots a
checkpoint gives up wait the same way (`req.stale_slots`): a HiCache load-back writes the
slots it gets at once, not in batch order. Retraction frees at once: it needs the memory for
the batch being built, no row is handed out again before the in-flight batch is processed,
and a slot freed now is rewritten only by a later batch (admission, so any load-back, comes
before retraction in a step, and the next step starts after the in-flight batch is processed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sglite import kv_events
from sglite.config import ServerArgs
from sglite.constrained import GrammarBackend, NullGrammarBackend
from sglite.constrained.grammar_queue import GrammarQueue
from sglite.logprobs import RowLogprobs
from sglite.mem_cache.factory import build_cache_manager
from sglite.messages import (
    AbortReq,
    FlushCacheReq,
    FlushCacheResp,
    GenerateReq,
    GetStatsReq,
    StatsResp,
)
from sglite.sampling_params import SamplingParams
from sglite.scheduler.batch import ScheduleBatch
from sglite.scheduler.chunk_sizer import build_sizer
from sglite.scheduler.decode import DecodeManager
from sglite.scheduler.decode_turns import DecodeTurns
from sglite.scheduler.heap import trim_heap
from sglite.scheduler.limits import RequestLimits
from sglite.scheduler.output import OutputStreamer
from sglite.scheduler.policy import SchedulePolicy
from sglite.scheduler.prefill import PrefillManager
from sglite.scheduler.priority import PriorityPreemptor
from sglite.scheduler.req import Req, StopChecker
from sglite.scheduler.results import ResultProcessor
from sglite.scheduler.watchdog import NullWatchdog
from sglite.scheduler.worker import Launched, Worker, WorkerClient

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        worker: Worker,
        *,
        core,
        allocator,
        req_to_token_pool,
        context_length: int,
        eos_token_ids: set[int],
        decode_tail: Callable[[list[int]], str],
        send: Callable[[object], None],
        send_control: Callable[[object], None] | None = None,
        watchdog: NullWatchdog | None = None,
        grammar_backend: GrammarBackend | None = None,
        dp_rank: int = 0,
        agree: Callable[[Any], Any] | None = None,  # TP: rank 0's value of a timed decision
        kv_pool=None,
        model_id: str = "",
    ):
        self.args = args
        self.core = core
        recorder, self.kv_publisher = kv_events.create(args.kv_events, args.page_size, dp_rank)
        self.cache = build_cache_manager(
            args, core, allocator, req_to_token_pool, recorder, kv_pool, model_id
        )
        sign = 1 if args.schedule_low_priority_values_first else -1
        self.policy = SchedulePolicy(
            args.schedule_policy, self.cache, core, args.random_seed,
            priority_sign=sign if args.enable_priority_scheduling else 0,
        )  # fmt: skip
        self.client = WorkerClient(worker, overlap=not args.disable_overlap_schedule)
        self.step = self.step_normal if args.disable_overlap_schedule else self.step_overlap
        self.limits = RequestLimits(context_length, allocator.capacity(), args.page_size, core)
        self.max_running = min(args.max_running_requests or 1 << 30, req_to_token_pool.size)
        self.stop_checker = StopChecker(eos_token_ids, decode_tail)
        self.streamer = OutputStreamer(send, args.stream_interval)
        self.send_control = send_control or send
        self.waiting: list[Req] = []
        # constrained requests wait here for their grammar before they may be admitted
        self.grammars = GrammarQueue(
            grammar_backend or NullGrammarBackend("this scheduler has no grammar backend"),
            args.grammar_compile_timeout,
            agree=agree,
        )
        self.running: list[Req] = []
        self.pending: tuple[ScheduleBatch, Launched] | None = None  # overlap: launched, unprocessed
        self.processed_tokens = 0
        self.ran_since_idle = False  # a batch ran since the last on_idle: trim the heap there
        self.counters = {
            "num_prefill_batches": 0, "num_decode_batches": 0, "num_chunks": 0,
            "num_retracted_reqs": 0, "num_finished_reqs": 0, "num_aborted_reqs": 0,
            "num_prompt_tokens_total": 0, "num_cached_tokens_total": 0,
            "num_generated_tokens_total": 0, "num_rejected_reqs": 0,
        }  # fmt: skip
        self.results = ResultProcessor(
            self.cache, self.client, self.stop_checker, self.streamer, self.counters
        )
        self.future_of = self.results.future_of  # id(req) -> future slot of its in-flight token
        self.releasing = self.results.releasing  # finished; a launched batch still reads its KV
        self.started_at = time.monotonic()
        self.watchdog = watchdog or NullWatchdog()
        self.decode = DecodeManager(self.cache, args.schedule_conservativeness, self._free_kv)
        self.prefill = PrefillManager(
            args, core, self.cache, self.policy, self.decode, self.max_running, self.counters,
            agree=agree,
        )  # fmt: skip
        self.preemptor = None
        if args.enable_priority_scheduling and not args.disable_priority_preemption:
            self.preemptor = PriorityPreemptor(
                core, self.cache, self.policy.rank,
                args.priority_scheduling_preemption_threshold, self._free_kv, self.counters,
            )  # fmt: skip
        if args.enable_dynamic_chunking and args.chunking_enabled:
            self.prefill.sizer = build_sizer(
                args.chunked_prefill_size, args.page_size, context_length,
                args.max_prefill_tokens, args.dynamic_chunking_smooth_factor,
                self.time_prefill, agree,
            )  # fmt: skip
        self.turns = DecodeTurns(args.prefill_decode_interval, args.max_consecutive_prefill_batches)

    # ---------------------------------------------------------------- loops
    def event_loop(self, recv: Callable[[bool], list]) -> None:
        """Forever: receive (blocking only when idle), then one step of the configured loop."""
        while True:
            self.handle_messages(recv(not self.has_work()))
            self.step()

    def step_normal(self) -> bool:
        self.watchdog.busy("scheduling")
        batch = self.get_next_batch_to_run()
        if batch is not None:
            self._finish_batch(batch, self.launch(batch))
        else:
            self.on_idle()
        self.kv_publisher.publish(self.cache.events.take())
        self.watchdog.idle()
        return batch is not None

    def step_overlap(self) -> bool:
        self.watchdog.busy("scheduling")
        if self.pending and (
            (self.pending[0].is_extend and (self.waiting or self.prefill.chunked_req))
            or self.pending[0].has_grammar
        ):
            # Maybe a second prefill in a row: process the first's result before building the
            # next batch, so its token is not delayed behind another long forward (and the new
            # batch is built only from requests still alive after that result). Constrained
            # rows: their matchers must see their last token before their next mask is built.
            self._process_pending()
        batch = self.get_next_batch_to_run()
        launched = self.launch(batch) if batch is not None else None
        self._process_pending()
        if batch is not None:
            self.pending = (batch, launched)
        else:
            self.on_idle()
        self.kv_publisher.publish(self.cache.events.take())
        self.watchdog.idle()
        return batch is not None

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Drive the configured loop in-process until nothing is left (tests, benchmarks)."""
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()
        raise RuntimeError(f"scheduler still busy after {max_steps} steps")

    def has_work(self) -> bool:
        return bool(
            self.waiting
            or self.running
            or self.pending
            or self.prefill.chunked_req
            or self.releasing
            or self.grammars
        )

    def frees_in_flight(self) -> bool:
        """Whether processing the in-flight result will free KV (finishers, releases)."""
        return bool(self.releasing) or any(
            r.finishing_in_flight and not r.finished for r in self.running
        )

    # ---------------------------------------------------------------- inputs
    def handle_messages(self, msgs: list) -> None:
        for msg in msgs:
            if isinstance(msg, GenerateReq):
                self.add_request(msg)
            elif isinstance(msg, AbortReq):
                self.abort(msg.rid, msg.abort_all, msg.message, msg.exact)
            elif isinstance(msg, FlushCacheReq):
                self.send_control(self.flush_cache())
            elif isinstance(msg, GetStatsReq):
                self.send_control(StatsResp(self.stats()))
            else:
                logger.error("scheduler: unknown message %r", type(msg).__name__)

    def add_request(self, msg: GenerateReq) -> Req:
        req = Req(
            msg.rid,
            list(msg.input_ids),
            msg.sampling_params,
            msg.stream,
            msg.extra_key,
            logprob=msg.logprob,
            priority=msg.priority or 0,
        )
        req.wait_since_processed = self.processed_tokens
        error = self.limits.refusal(len(req.input_ids), req.max_new_tokens)
        if error is not None:
            self.counters["num_rejected_reqs"] += 1
            self._refuse(req, 400, error)
            return req
        if req.sampling_params.grammar_key is not None:
            self.grammars.add(req)  # the grammar gate: admitted once its grammar compiled
        else:
            self.waiting.append(req)
        return req

    def abort(
        self, rid: str, abort_all: bool = False, message: str = "aborted", exact: bool = False
    ) -> None:
        """Finish the matching requests now (rid prefix, or exactly `rid`, or all); KV that a
        launched batch still reads is freed once that batch's result is processed."""

        def hit(r: Req) -> bool:
            return abort_all or (r.rid == rid if exact else r.rid.startswith(rid))

        victims = [r for r in self.waiting if hit(r)] + self.grammars.remove(hit)
        if victims:
            self.waiting = [r for r in self.waiting if not hit(r)]
        chunked = self.prefill.chunked_req
        if chunked is not None and hit(chunked):
            self.prefill.chunked_req = None
            victims.append(chunked)
        running = [r for r in self.running if hit(r) and not r.finished]
        if running:
            self.running = [r for r in self.running if not hit(r) and not r.finished]
        victims += running
        for req in victims:
            self.finish(req, {"type": "abort", "message": message, "status_code": 499})
        self.streamer.stream(victims)

    # ---------------------------------------------------------------- batches
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        if self.grammars:
            self._admit_compiled()
        if self.preemptor is not None and self.waiting:
            victims = self.preemptor.make_room(self.waiting, self.running, self.decode.ratio.value)
            self.waiting[:0] = sorted(victims, key=lambda r: r.arrival_time)
        batch = None
        if self.turns.may_prefill(bool(self.decode.decodable(self.running))):
            batch = self.prefill.get_new_batch(self.waiting, self.running, self.processed_tokens)
        if batch is None:
            batch = self._decode_batch()
        if batch is not None:
            self.turns.ran(batch.mode.value != "decode")
        if batch is None and self.waiting and not self._holds_kv():
            self._refuse_head()
        return batch

    def _admit_compiled(self) -> None:
        ready, refused = self.grammars.poll()
        self.waiting += ready
        for r in refused:
            self.counters["num_rejected_reqs"] += 1
            self._refuse(r.req, r.status_code, r.message)

    def _decode_batch(self) -> ScheduleBatch | None:
        step = self.decode.get_batch(self.running, self.prefill.chunked_req, self.frees_in_flight())
        if step.retracted or step.out_of_memory:
            if self.prefill.chunked_req in step.retracted:
                self.prefill.chunked_req = None
            gone = {id(r) for r in step.retracted}
            self.running = [r for r in self.running if id(r) not in gone]
            self.waiting[:0] = sorted(step.retracted, key=lambda r: r.arrival_time)
            self.counters["num_retracted_reqs"] += len(step.retracted)
        if step.out_of_memory is not None:
            self.running.remove(step.out_of_memory)
            self._refuse(
                step.out_of_memory,
                503,
                "the request does not fit in the KV cache even with all others retracted",
            )
        return step.batch

    def _free_kv(self, req: Req) -> None:
        """Retraction frees at once (see the module doc): nothing is published."""
        self.cache.release(req, insert=False)
        self.client.release([req.rid])
        self.future_of.pop(id(req), None)

    def _holds_kv(self) -> bool:
        """Whether anything but the tree's unlocked cache holds KV memory (or soon frees it)."""
        return bool(
            self.pending
            or self.releasing
            or self.prefill.chunked_req
            or any(not r.finished for r in self.running)
        )

    def _refuse_head(self) -> None:
        """Safety net: the KV cache is idle and still the head of the queue was not admitted
        (see limits.py); finish it rather than retry it forever."""
        req = self.waiting.pop(0)
        message = self.limits.idle_refusal(req.fill_len, req.max_new_tokens)
        logger.error("request %s refused: %s", req.rid, message)
        self.counters["num_rejected_reqs"] += 1
        self._refuse(req, 400, message)

    def _refuse(self, req: Req, status_code: int, message: str) -> None:
        """Finish `req` with an error and tell its client at once."""
        self.finish(req, {"type": "abort", "message": message, "status_code": status_code})
        self.streamer.stream([req])

    def time_prefill(self, length: int) -> float:
        """One real prefill of `length` seeded random tokens alone, in ms (the dynamic chunk
        sizer's start-up profile); its KV is freed, nothing is cached or counted."""
        ids = np.random.default_rng(length).integers(0, 1000, length).tolist()
        req = Req(f"profile-{length}", ids, SamplingParams(max_new_tokens=1))
        self.cache.lock(req.match_node)  # the root: nothing matched, as admission locks it
        if not self.cache.alloc_rows([req]):
            raise RuntimeError("no request row for the start-up profile")
        slots = self.cache.alloc_extend([req], [0], [length])
        if slots is None:
            self.cache.release(req, insert=False)
            raise RuntimeError(f"no KV room for a {length}-token start-up profile prefill")
        batch = ScheduleBatch([req], [0], [length], [False], out_cache_loc=slots)
        batch.future_slots = self.client.future_slots(1)
        fi = batch.forward_input({})
        if self.cache.mirrored:
            fi.table_rows = self.cache.table[fi.rows, :length].copy()
        start = time.perf_counter()
        self.client.launch(fi).result()
        ms = (time.perf_counter() - start) * 1000
        req.kv_len = length
        self.cache.release(req, insert=False)
        self.client.release([req.rid])
        return ms

    def launch(self, batch: ScheduleBatch) -> Launched:
        batch.future_slots = self.client.future_slots(len(batch.reqs))
        fi = batch.forward_input(self.future_of)
        batch.has_grammar = fi.vocab_mask is not None
        for req, slot, samples in zip(batch.reqs, batch.future_slots.tolist(), batch.sample_mask):
            req.in_flight += 1
            if samples:
                self.future_of[id(req)] = slot
                req.scheduled_outputs += 1
        if self.cache.mirrored:
            fi.table_rows = self.cache.table[fi.rows, : int(fi.seq_lens.max())].copy()
        self.processed_tokens += batch.num_tokens
        self.ran_since_idle = True
        key = "num_decode_batches" if batch.mode.value == "decode" else "num_prefill_batches"
        self.counters[key] += 1
        self.watchdog.busy(f"forward of {batch.describe()}")  # the normal loop runs it here
        return self.client.launch(fi)

    def _process_pending(self) -> None:
        if self.pending is not None:
            batch, launched = self.pending
            self.pending = None
            self._finish_batch(batch, launched)

    def _finish_batch(self, batch: ScheduleBatch, launched: Launched) -> None:
        self.watchdog.busy(f"forward of {batch.describe()}")
        tokens = launched.result()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("ran %s", batch.describe())
        self.watchdog.busy(f"processing the result of {batch.describe()}")
        self.process_batch_result(batch, tokens, launched.logprobs)

    # ---------------------------------------------------------------- results
    def process_batch_result(
        self,
        batch: ScheduleBatch,
        tokens: np.ndarray,
        logprobs: list[RowLogprobs | None] | None = None,
    ) -> None:
        self.results.process(batch, tokens, logprobs)
        if any(r.finished for r in self.running):
            self.running = [r for r in self.running if not r.finished]

    def finish(self, req: Req, reason: dict[str, Any]) -> None:
        self.results.finish(req, reason)

    def on_idle(self) -> None:
        if self.has_work():
            if self.grammars:  # no batch to run: give the compile threads the CPU
                self.grammars.wait()
            return
        self.decode.ratio.reset()
        self.cache.tier.on_idle()  # HiCache: queued file-tier pages reach the disk
        if self.args.debug_invariants:
            self.cache.check_idle()
        if self.ran_since_idle:
            self.ran_since_idle = False
            trim_heap()

    # ---------------------------------------------------------------- control
    def flush_cache(self) -> FlushCacheResp:
        if self.has_work():
            return FlushCacheResp(False, "cannot flush the cache while requests are running")
        self.cache.flush()
        return FlushCacheResp(True)

    def stats(self) -> dict[str, Any]:
        c = self.counters
        prompt = c["num_prompt_tokens_total"]
        return {
            **c,
            **self.cache.kv_stats(),
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting)
            + len(self.grammars)
            + (self.prefill.chunked_req is not None),
            **self.grammars.stats(),
            "cache_hit_rate": c["num_cached_tokens_total"] / prompt if prompt else 0.0,
            **self.cache.tier.hit_tokens(c["num_cached_tokens_total"]),
            "waiting_hit_tokens": self.policy.waiting_hit_tokens(self.waiting),
            "new_token_ratio": self.decode.ratio.value,
            **self.prefill.delayer.stats(),
            "uptime_s": time.monotonic() - self.started_at,
        }
