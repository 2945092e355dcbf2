"""DecodeManager: the next decode batch, its KV slots, retraction, and new_token_ratio.

When one more token per running request does not fit (after evicting from the tree), and no
in-flight result is about to free memory (then the step is skipped instead), the requests
with the fewest decoded tokens (ties: longest prompt) are retracted until it does: their KV
is freed without being inserted (`free_kv`, given by the scheduler), and the scheduler puts
them back at the front of the waiting queue, to be prefilled again (prompt + what they
generated). The request being chunked is a candidate too (it holds KV and decodes nothing).
A request that does not fit even alone is reported as out of memory (the scheduler aborts it
with 503); admission rules that out for every request it accepted. new_token_ratio, the
share of each request's remaining max_new_tokens that admission reserves, starts at 0.7,
decays by (0.7 - 0.098) / 600 per decode step, and jumps after a retraction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from sglite.mem_cache.cache_manager import CacheManager
from sglite.scheduler.batch import ScheduleBatch
from sglite.scheduler.req import Req

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


@dataclass
class DecodeStep:
    """What `DecodeManager.get_batch` decided."""

    batch: ScheduleBatch | None
    retracted: list[Req] = field(default_factory=list)  # KV freed: requeue them
    out_of_memory: Req | None = None  # does not fit even alone: abort it


class DecodeManager:
    def __init__(
        self, cache: CacheManager, conservativeness: float, free_kv: Callable[[Req], None]
    ):
        self.cache = cache
        self.ratio = NewTokenRatio(conservativeness)
        self.free_kv = free_kv  # frees a victim's KV at once, without publishing it

    @staticmethod
    def decodable(running: list[Req]) -> list[Req]:
        """Running requests that need another token (finishers in flight sit out)."""
        return [
            r for r in running
            if r.finished_reason is None and r.scheduled_outputs < r.sampling_params.max_new_tokens
        ]  # fmt: skip

    def get_batch(
        self, running: list[Req], chunked: Req | None, frees_in_flight: bool
    ) -> DecodeStep:
        """One more token for every decodable request; `frees_in_flight`: the pending result
        will free KV (then a step that does not fit is skipped rather than retracting)."""
        reqs = self.decodable(running)
        step = DecodeStep(None)
        if not reqs:
            return step
        if self.cache.can_decode(reqs):
            self.ratio.decay_step()
        elif frees_in_flight:
            return step
        else:
            reqs = self._retract(reqs, chunked, step)
            if not reqs:
                return step
        starts, ends, slots = self._alloc(reqs)
        step.batch = ScheduleBatch(reqs, starts, ends, [True] * len(reqs), out_cache_loc=slots)
        return step

    def mix_into(self, batch: ScheduleBatch, running: list[Req]) -> None:
        """Append decode rows to a prefill batch (--enable-mixed-chunk) when they fit."""
        reqs = [r for r in running if not r.finished and not r.finishing_in_flight]
        if not reqs or not self.cache.can_decode(reqs):
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
        slots = self.cache.alloc_extend(reqs, starts, ends)
        if slots is None:
            raise RuntimeError("decode allocation failed after the capacity check passed")
        for r in reqs:
            r.kv_len += 1
        return starts, ends, slots

    def _retract(self, reqs: list[Req], chunked: Req | None, step: DecodeStep) -> list[Req]:
        candidates = reqs + [chunked] if chunked is not None else list(reqs)
        # pop() takes the fewest decoded (ties: longest prompt) first
        order = sorted(
            candidates, key=lambda r: (len(r.output_ids), -len(r.input_ids)), reverse=True
        )
        kept = list(reqs)
        while kept and not self.cache.can_decode(kept):
            victim = order.pop()
            if not order:  # only this request is left
                kept.remove(victim)
                step.out_of_memory = victim
                break
            if victim is not chunked:
                kept.remove(victim)
            self.free_kv(victim)
            victim.reset_for_retract()
            step.retracted.append(victim)
        old = self.ratio.value
        self.ratio.after_retract(kept)
        logger.warning(
            "KV cache is full: retracted %d requests; new_token_ratio %.3f -> %.3f",
            len(step.retracted), old, self.ratio.value,
        )  # fmt: skip
        return kept
