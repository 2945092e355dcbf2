"""PriorityPreemptor: running requests make room for a waiting one of much higher priority.

With --enable-priority-scheduling the waiting queue is ordered by priority first (policy.py;
higher values first, or lower with --schedule-low-priority-values-first). Before a prefill
pass, if the first waiting request does not fit by the budget's rule, running requests whose
priority is worse than its by more than --priority-scheduling-preemption-threshold (10) are
retracted, worst priority first and newest first among equals, until it fits; they go back to
the waiting queue (their KV is freed, their output so far kept) and resume when their turn
comes, so a low-priority request still finishes once the higher ones are served. Nothing is
retracted unless retracting all eligible ones would make the request fit (no useless churn),
and the request being chunked, or one whose finish is in flight, is never a victim.
"""

from __future__ import annotations

from collections.abc import Callable

from sglite.mem_cache.cache_manager import CacheManager
from sglite.scheduler.req import Req

NO_LIMIT = 1 << 40


class PriorityPreemptor:
    def __init__(
        self,
        core,
        cache: CacheManager,
        rank: Callable[[Req], int],
        threshold: int,
        free_kv: Callable[[Req], None],
        counters: dict[str, int],
    ):
        self.core = core
        self.cache = cache
        self.rank = rank
        self.threshold = threshold
        self.free_kv = free_kv
        self.counters = counters
        counters.setdefault("num_preempted_reqs", 0)

    def make_room(self, waiting: list[Req], running: list[Req], ratio: float) -> list[Req]:
        """Retract running requests for the best waiting one if that makes it fit; the victims
        are removed from `running` and returned (the caller requeues them)."""
        if not waiting or not running:
            return []
        head = min(waiting, key=lambda r: (self.rank(r), r.arrival_time))
        victims = [
            r for r in running
            if not r.finished and not r.finishing_in_flight and r.row is not None
            and self.rank(r) - self.rank(head) > self.threshold
        ]  # fmt: skip
        if not victims:
            return []
        kept = [r for r in running if r not in victims]
        freed = sum(r.kv_len - r.cached_len for r in victims)
        if self._shortfall(head, kept, ratio, freed) > 0:
            return []  # even all of them would not make room
        victims.sort(key=lambda r: (-self.rank(r), -r.arrival_time))
        out: list[Req] = []
        live = [r for r in running if not r.finished]
        while victims and self._shortfall(head, live, ratio, 0) > 0:
            victim = victims.pop(0)
            live.remove(victim)
            running.remove(victim)
            self.free_kv(victim)
            victim.reset_for_retract()
            out.append(victim)
        self.counters["num_preempted_reqs"] += len(out)
        return out

    def _shortfall(self, head: Req, running: list[Req], ratio: float, extra: int) -> int:
        budget = self.core.PrefillBudget(self.cache.page_size, NO_LIMIT)
        budget.reserve_running(
            [r.remaining_new_tokens for r in running],
            [r.sampling_params.ignore_eos for r in running],
            ratio,
        )
        available = self.cache.available_and_evictable() + extra
        max_new = max(head.remaining_new_tokens, 0)
        return budget.shortfall(available, max(head.fill_len, 1), max_new)
