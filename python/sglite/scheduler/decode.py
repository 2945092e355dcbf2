"""DecodeManager: the next decode batch, its KV slots, retraction, and new_token_ratio.

When one more token per running request does not fit (after evicting from the tree), and no
in-flight result is about to free memory (then the step is skipped instead), the requests
with the fewest decoded tokens (ties: longest prompt) are retracted until it does: their KV
is freed without being inserted, and they go back to the front of the waiting queue to be
prefilled again (prompt + what they generated). The request being chunked is a candidate
too (it holds KV and decodes nothing). A request is aborted (503) only when it does not fit
even alone, which admission rules out for every request it accepted. new_token_ratio, the share of each
request's remaining max_new_tokens that admission reserves, starts at 0.7, decays by
(0.7 - 0.098) / 600 per decode step, and jumps after a retraction.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from sglite.scheduler.batch import ScheduleBatch
from sglite.scheduler.req import Req

if TYPE_CHECKING:
    from sglite.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20


class NewTokenRatio:
    def __init__(self, conservativeness: float = 1.0) -> None:
        self.init = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        self.min = self.init * MIN_NEW_TOKEN_RATIO_FACTOR
        self.decay = (self.init - self.min) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.value = self.init

    def decay_step(self) -> None:
        self.value = max(self.value - self.decay, self.min)

    def reset(self) -> None:
        self.value = self.init

    def after_retract(self, remaining: list[Req]) -> None:
        decoded = sum(len(r.output_ids) for r in remaining)
        max_new = sum(r.max_new_tokens for r in remaining)
        self.value = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(remaining)) / (max_new + 1))


class DecodeManager:
    def __init__(self, sched: Scheduler):
        self.s = sched
        self.ratio = NewTokenRatio(sched.args.schedule_conservativeness)

    def decodable(self) -> list[Req]:
        """Running requests that need another token (finishers in flight sit out)."""
        return [
            r for r in self.s.running
            if r.finished_reason is None and r.scheduled_outputs < r.sampling_params.max_new_tokens
        ]  # fmt: skip

    def get_batch(self) -> ScheduleBatch | None:
        reqs = self.decodable()
        if not reqs:
            return None
        if self.s.cache.can_decode(reqs):
            self.ratio.decay_step()
        elif self.s.frees_in_flight():
            return None  # the pending result frees memory: wait for it rather than retract
        else:
            reqs = self._retract(reqs)
            if not reqs:
                return None
        starts, ends, slots = self._alloc(reqs)
        return ScheduleBatch(reqs, starts, ends, [True] * len(reqs), out_cache_loc=slots)

    def mix_into(self, batch: ScheduleBatch, running: list[Req]) -> None:
        """Append decode rows to a prefill batch (--enable-mixed-chunk) when they fit."""
        reqs = [r for r in running if not r.finished and not r.finishing_in_flight]
        if not reqs or not self.s.cache.can_decode(reqs):
            return
        starts, ends, slots = self._alloc(reqs)
        batch.reqs += reqs
        batch.starts += starts
        batch.ends += ends
        batch.is_decode += [True] * len(reqs)
        batch.epochs += [r.epoch for r in reqs]
        batch.refresh_sample_mask()
        batch.out_cache_loc = np.concatenate([batch.out_cache_loc, slots])

    def _alloc(self, reqs: list[Req]):
        starts = [r.kv_len for r in reqs]
        ends = [r.kv_len + 1 for r in reqs]
        slots = self.s.cache.alloc_extend(reqs, starts, ends)
        if slots is None:
            raise RuntimeError("decode allocation failed after the capacity check passed")
        for r in reqs:
            r.kv_len += 1
        return starts, ends, slots

    def _retract(self, reqs: list[Req]) -> list[Req]:
        s = self.s
        chunked = s.prefill.chunked_req
        candidates = reqs + [chunked] if chunked is not None else list(reqs)
        # pop() takes the fewest decoded (ties: longest prompt) first
        order = sorted(
            candidates, key=lambda r: (len(r.output_ids), -len(r.input_ids)), reverse=True
        )
        kept = list(reqs)
        retracted: list[Req] = []
        while kept and not s.cache.can_decode(kept):
            victim = order.pop()
            if not order:  # even alone it does not fit
                kept.remove(victim)
                s.finish(victim, {
                    "type": "abort", "status_code": 503,
                    "message": "out of KV cache memory even after retracting all other requests",
                })  # fmt: skip
                s.streamer.stream([victim])
                break
            if victim is chunked:
                s.prefill.chunked_req = None
            else:
                kept.remove(victim)
            s.cache.release(victim, insert=False)  # at once: see the scheduler's module doc
            s.client.release([victim.rid])
            s.future_of.pop(id(victim), None)
            victim.reset_for_retract()
            retracted.append(victim)
        gone = {id(r) for r in retracted}
        s.running = [r for r in s.running if id(r) not in gone and not r.finished]
        s.waiting[:0] = sorted(retracted, key=lambda r: r.arrival_time)
        s.counters["num_retracted_reqs"] += len(retracted)
        old = self.ratio.value
        self.ratio.after_retract(kept)
        logger.warning(
            "KV cache is full: retracted %d requests; new_token_ratio %.3f -> %.3f",
            len(retracted), old, self.ratio.value,
        )  # fmt: skip
        return kept
