"""PrefillDelayer: SGLang's prefill delayer (--enable-prefill-delayer), one decision per pass.

It holds a prefill back while admitting it now would be wasteful, always for a bounded time:
- slot condition: the free request slots (max running - running) are fewer than the largest
  prefill batch of the last 16 attempts, so the batch would be cut short; wait for more room;
- queue condition (opt-in, --prefill-delayer-queue-min-ratio r): while requests run, fewer
  than min(int(running * r), that largest batch) wait; wait for more to arrive. This one is
  also bounded by --prefill-delayer-max-delay-ms of wall clock (default 5000).
Releases: a pass in which nothing is prefillable allows and resets; token usage under
--prefill-delayer-token-usage-low-watermark forces the prefill through; and at most
--prefill-delayer-max-delay-passes - 1 passes in a row are delayed (default 30), so a prefill
that stays delayable still runs by the max-th pass (liveness). The first firing in the
engine's life is let through. Each episode's count and start are reset on every allow.

One decision per pass, taken at the first candidate that would be admitted (the request
being chunked always proceeds, and a "delay" then refuses new ones in that pass). SGLang
gathers one row per rank and decides on the gathered rows: every TP rank here schedules the
same inputs, so the rows agree except for the clock; the timeout flag is rank 0's (`agree`).
Outcomes are counted as SGLang labels them (estimation, allow, reason).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

WINDOW = 16  # attempts the largest-prefill-batch tracker remembers
DEFAULT_MAX_DELAY_MS = 5000.0


@dataclass(frozen=True)
class DelayState:
    delayed_count: int
    start_time: float


@dataclass(frozen=True)
class Row:
    """One rank's view of this pass (SGLang gathers it across ranks)."""

    prefillable: bool
    force: bool  # prefillable and token usage under the low watermark
    running_bs: int
    max_prefill_bs: int
    waiting_len: int
    timed_out: bool  # queue trigger on, an episode exists and it is older than max_delay_ms


@dataclass(frozen=True)
class DelayerConfig:
    max_running_requests: int
    max_delay_passes: int = 30
    token_usage_low_watermark: float | None = None
    queue_min_ratio: float | None = None
    max_delay_ms: float = DEFAULT_MAX_DELAY_MS
    prefill_max_requests: int | None = None
    num_dp_ranks: int = 1


def negotiate(
    prev: DelayState | None, rows: list[Row], cfg: DelayerConfig, skip_first: bool, now: float
) -> tuple[DelayState | None, bool, str, str, bool]:
    """The pure rule: (next state, allow, reason, estimation, skip_first after)."""
    prefillable = [r.prefillable for r in rows]
    if not any(prefillable):
        return None, True, "", "none", skip_first
    forced = any(r.force for r in rows)
    if not all(prefillable):
        if forced:
            return None, True, "token_watermark", "mixed", skip_first
        return _delay_or_timeout(prev, cfg, now, "mixed", skip_first)
    if forced:
        return None, True, "token_watermark", "all", skip_first
    max_running = math.ceil(cfg.max_running_requests / cfg.num_dp_ranks)
    running = max(r.running_bs for r in rows)
    largest = max(r.max_prefill_bs for r in rows)
    waiting = max(r.waiting_len for r in rows)
    slot = max_running - running < largest
    queue = False
    if cfg.queue_min_ratio is not None and running > 0:
        cap = cfg.prefill_max_requests if cfg.prefill_max_requests is not None else largest
        target = min(int(running * cfg.queue_min_ratio), cap)
        queue = target > 0 and waiting < target and not any(r.timed_out for r in rows)
    if slot or queue:
        if skip_first:
            return None, True, "no_wait", "all", False
        return _delay_or_timeout(prev, cfg, now, "all", skip_first)
    return None, True, "wait_success" if prev is not None else "no_wait", "all", skip_first


def _delay_or_timeout(prev, cfg, now, estimation, skip_first):
    count = prev.delayed_count if prev is not None else 0
    if count < cfg.max_delay_passes - 1:
        start = prev.start_time if prev is not None else now
        return DelayState(count + 1, start), False, "delay", estimation, skip_first
    return None, True, "wait_timeout", estimation, skip_first


class PrefillBatchTracker:
    """The largest of the last WINDOW non-empty prefill attempts (decode passes do not age it)."""

    def __init__(self, window: int = WINDOW):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.sizes: deque[int] = deque(maxlen=window)

    def record(self, size: int) -> None:
        if size > 0:
            self.sizes.append(size)

    @property
    def max_prefill_bs(self) -> int:
        return max(self.sizes, default=0)


class NoDelayer:
    """--enable-prefill-delayer off: every pass allows."""

    def start(self, usage: float, running_bs: int, waiting_len: int) -> None:
        pass

    def allows(self) -> bool:
        return True

    def finish(self, actual_bs: int) -> None:
        pass

    def stats(self) -> dict:
        return {}


class PrefillDelayer:
    """Per pass: `start(...)`, then `allows()` at most once (cached), `finish(actual)`."""

    def __init__(
        self,
        cfg: DelayerConfig,
        counters: dict,
        clock: Callable[[], float] = time.monotonic,
        agree: Callable[[bool], bool] | None = None,
    ):
        self.cfg = cfg
        self.counters = counters
        self.clock = clock
        self.agree = agree or (lambda flag: flag)
        self.state: DelayState | None = None
        self.skip_first = True
        self.tracker = PrefillBatchTracker()
        self.outcomes: dict[tuple[str, bool, str], int] = {}
        counters.setdefault("num_prefill_delays", 0)
        self._verdict: bool | None = None

    def start(self, usage: float, running_bs: int, waiting_len: int) -> None:
        self._usage, self._running, self._waiting = usage, running_bs, waiting_len
        self._verdict = None

    def allows(self) -> bool:
        """A candidate (or the chunked request) is prefillable: negotiate once this pass."""
        if self._verdict is None:
            self._verdict = self._negotiate(True)
        return self._verdict

    def finish(self, actual_bs: int) -> None:
        """The pass's batch is built (`actual_bs` new requests; 0: none). Every pass
        negotiates, prefillable or not; the tracker learns the size attempted."""
        prefillable = self._verdict is not None
        if not prefillable:
            self._negotiate(False)
        running, cap = self._running, self.cfg.max_running_requests
        attempted = min(max(self._waiting, 1), max(cap - running, 1)) if prefillable else 0
        self.tracker.record(actual_bs or attempted)

    def stats(self) -> dict:
        """The outcome counter, one entry per label set (SGLang's label names)."""
        rows = [
            {"input_estimation": e, "output_allow": a, "output_reason": r, "count": n}
            for (e, a, r), n in sorted(self.outcomes.items())
        ]
        return {"prefill_delayer_outcomes": rows}

    def _negotiate(self, prefillable: bool) -> bool:
        cfg, now = self.cfg, self.clock()
        timed_out = False
        if cfg.queue_min_ratio is not None and self.state is not None:
            timed_out = self.agree((now - self.state.start_time) * 1000 >= cfg.max_delay_ms)
        low = cfg.token_usage_low_watermark
        row = Row(
            prefillable,
            prefillable and low is not None and self._usage < low,
            self._running,
            self.tracker.max_prefill_bs,
            self._waiting,
            timed_out,
        )
        self.state, allow, reason, estimation, self.skip_first = negotiate(
            self.state, [row], cfg, self.skip_first, now
        )
        key = (estimation, allow, reason)
        self.outcomes[key] = self.outcomes.get(key, 0) + 1
        if not allow:
            self.counters["num_prefill_delays"] += 1
        return allow
