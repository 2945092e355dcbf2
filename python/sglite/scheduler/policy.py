"""SchedulePolicy: the order of the waiting queue (fcfs, lpm, dfs-weight, lof, random, hrrn, spf).

- Cache-aware policies match every waiting request's prefix in the radix tree each pass (a
  match is reused while the tree has not changed: `CacheManager.version`); cache-agnostic ones
  match none here: the PrefillAdder matches the candidates it considers.
- LPM and HRRN fall back to FCFS when more than 128 requests wait: matching costs CPU.
- In-queue prefix check (cache-aware policies): a request whose cached prefix is short but
  which shares >= 32 tokens with an earlier waiting request is deprioritized for this pass, so
  only one of many requests sharing an uncached prefix goes first; the rest then hit the cache.
- Within one prefill batch (every policy): a request that would compute >= 32 prompt tokens
  that an earlier request of the same batch (or the request being chunked) computes stays
  waiting for this pass (`BatchPrefixGate`); when it is admitted, those tokens are cached. So
  16 requests arriving together with one uncached system prompt compute it once.
- The matching pass walks the queue tail first, so the head's prefix is the most recently used:
  with LRU eviction the cache retires queued prefixes in reverse admission order.
"""

from __future__ import annotations

import random

import numpy as np

from sglite.mem_cache.cache_manager import CacheManager
from sglite.scheduler.req import Req

CACHE_AWARE = ("lpm", "dfs-weight", "hrrn", "shortest-prefill-first")
FCFS_FALLBACK_QUEUE_LEN = 128
IN_QUEUE_CHECK_THRESHOLD = 32
IN_QUEUE_DEPRIORITIZE_THRESHOLD = 32


class SchedulePolicy:
    def __init__(
        self, policy: str, cache: CacheManager, core, seed: int = 0, priority_sign: int = 0
    ):
        if not cache.enabled and policy in CACHE_AWARE:
            policy = "fcfs"  # nothing to be aware of
        self.policy = policy
        self.cache = cache
        self.core = core
        self.rng = random.Random(seed)
        self.num_passes = 0
        # --enable-priority-scheduling: 1 low values first, -1 high values first, 0 off
        self.priority_sign = priority_sign

    def active_policy(self, queue_len: int) -> str:
        if self.policy in ("lpm", "hrrn") and queue_len > FCFS_FALLBACK_QUEUE_LEN:
            return "fcfs"
        return self.policy

    def sort(self, queue: list[Req], processed_tokens: int) -> None:
        """Reorder `queue` in place; with a cache-aware policy every request's match is current.
        With priority scheduling, priority comes first and the policy's order breaks ties (a
        stable sort after it), so cache awareness holds within a priority level."""
        self.num_passes += 1
        self._sort_by_policy(queue, processed_tokens)
        if self.priority_sign:
            queue.sort(key=self.rank)

    def rank(self, req: Req) -> int:
        """Priority order: lower ranks go first."""
        return req.priority * self.priority_sign

    def _sort_by_policy(self, queue: list[Req], processed_tokens: int) -> None:
        policy = self.active_policy(len(queue))
        if policy == "fcfs":
            return
        if policy == "lof":
            queue.sort(key=lambda r: -r.max_new_tokens)
            return
        if policy == "random":
            self.rng.shuffle(queue)
            return
        for r in reversed(queue):
            self.cache.match(r)
        deprioritized = self._in_queue_check(queue)
        if policy == "lpm":
            queue.sort(key=lambda r: (id(r) in deprioritized, -r.hit_len))
        elif policy == "dfs-weight":
            order = self.cache.tree.dfs_weight_order([r.match_node for r in queue])
            queue[:] = [queue[i] for i in order]
        elif policy == "hrrn":

            def response_ratio(r: Req) -> tuple:
                uncached = r.fill_len - r.hit_len
                waited = processed_tokens - r.wait_since_processed
                return (id(r) in deprioritized, -(waited / max(uncached, 1)), r.arrival_time)

            queue.sort(key=response_ratio)
        elif policy == "shortest-prefill-first":
            queue.sort(
                key=lambda r: (
                    id(r) in deprioritized,
                    max(1, r.fill_len - r.hit_len),
                    r.arrival_time,
                )
            )

    def waiting_hit_tokens(self, queue: list[Req]) -> int:
        """Metric: waiting tokens that would hit the cache now."""
        return sum(self.cache.match(r) for r in reversed(queue))

    def _in_queue_check(self, queue: list[Req]) -> set[int]:
        """Ids of requests to push back: they share an uncached prefix with an earlier one."""
        sim = self.core.RadixTree(page_size=1)
        out: set[int] = set()
        for r in queue:
            if r.match_len > IN_QUEUE_CHECK_THRESHOLD:
                continue
            ids = r.input_arr
            shared, _ = sim.match_prefix(ids)
            if len(shared) >= IN_QUEUE_DEPRIORITIZE_THRESHOLD:
                out.add(id(r))
            else:
                sim.insert(ids, np.arange(len(ids)))
        return out


class BatchPrefixGate:
    """Keeps requests that would recompute an uncached prefix out of the batch computing it."""

    def __init__(self, core, enabled: bool):
        self.sim = core.RadixTree(page_size=1) if enabled else None

    def add(self, req: Req) -> None:
        """`req` computes its prompt (or the rest of it) in this batch."""
        if self.sim is not None:
            ids = req.input_arr
            self.sim.insert(ids, np.arange(len(ids)))

    def defers(self, req: Req) -> bool:
        """True if `req` shares >= the threshold uncached tokens with a request added before."""
        if self.sim is None:
            return False
        shared, _ = self.sim.match_prefix(req.input_arr)
        return len(shared) - req.match_len >= IN_QUEUE_DEPRIORITIZE_THRESHOLD
