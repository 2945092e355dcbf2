"""Watchdog: notices a scheduler step that never ends, and makes the stall visible.

The scheduler calls `busy(activity)` when a step (a scheduling pass, a forward, result
processing) starts or changes phase, and `idle()` when the step ends and the loop waits for
messages. `NullWatchdog` (tests, benchmarks) does nothing.

`Watchdog` is the real one. A daemon thread checks every `poll_s`; when one phase has lasted
`--watchdog-timeout` seconds it calls `on_timeout(activity, stalled_s)`, by default
`exit_process`: log the activity, dump the stacks of all threads, `os._exit(WATCHDOG_EXIT_CODE)`.
The launcher maps that exit code to a sentence naming the watchdog and shuts the server down.

The start of the current phase is also written to a `Heartbeat`, a double in shared memory
created by the launcher, so the main process's `/health` answers 503 once a phase has lasted
`stall_threshold(watchdog_timeout)` seconds, well before the watchdog fires. Timestamps are
`time.monotonic()`, a system-wide clock on the platforms we run on, so both processes can
compare them; the main process reads the double without the scheduler's cooperation, so a
stall shows even when the scheduler cannot run Python at all.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import math
import multiprocessing.sharedctypes
import os
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

WATCHDOG_EXIT_CODE = 75  # distinct from crashes (1), signals (< 0); the launcher names it
HEALTH_STALL_S = 20.0  # SGLang's health-check timeout (SGLANG_HEALTH_CHECK_TIMEOUT)
MAX_POLL_S = 2.0
_IDLE = math.nan


def stall_threshold(watchdog_timeout: float) -> float:
    """Seconds one step may run before /health reports the scheduler unhealthy."""
    return min(watchdog_timeout, HEALTH_STALL_S)


class NullWatchdog:
    """No watchdog: every call is a no-op."""

    def busy(self, activity: str) -> None:
        """A step starts, or the current one moves on to `activity` (said in the log)."""

    def idle(self) -> None:
        """The step ended; waiting for messages is not a stall."""


class Heartbeat:
    """When the scheduler's current phase started (monotonic seconds), or idle.

    `Heartbeat.shared()` lives in shared memory and is passed to the spawned scheduler
    process (it pickles only while a child is being spawned); `Heartbeat()` is process-local
    (tests, and the default of callers that have no scheduler process). One writer (the
    scheduler's main thread); readers see either the old or the new aligned double.
    """

    def __init__(self, cell: ctypes.c_double | None = None):
        self._cell = cell if cell is not None else ctypes.c_double(_IDLE)

    @classmethod
    def shared(cls) -> Heartbeat:
        return cls(multiprocessing.sharedctypes.RawValue(ctypes.c_double, _IDLE))

    def beat(self, since: float) -> None:
        self._cell.value = since

    def rest(self) -> None:
        self._cell.value = _IDLE

    def busy_for(self, now: float) -> float:
        """How long the current phase has lasted at `now`; 0 when idle."""
        since = self._cell.value
        return 0.0 if math.isnan(since) else max(now - since, 0.0)


class Watchdog(NullWatchdog):
    """Calls `on_timeout(activity, stalled_s)` once when one phase lasts `timeout_s`.

    `busy` and `idle` run on the scheduler's hot path: a clock read and two stores, no lock
    (the phase is one tuple, replaced atomically under the GIL). `check(now)` is the whole
    decision and is pure given the calls so far, so tests drive it with a fake clock;
    `start()` runs it on a daemon thread.
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        heartbeat: Heartbeat | None = None,
        on_timeout: Callable[[str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float | None = None,
    ):
        if not timeout_s > 0:
            raise ValueError(f"watchdog timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.heartbeat = heartbeat or Heartbeat()
        self.on_timeout = on_timeout or self.exit_process
        self.poll_s = poll_s if poll_s is not None else min(timeout_s / 10, MAX_POLL_S)
        self._clock = clock
        self._phase: tuple[float, str] | None = None  # (started at, activity) or idle
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- hot path
    def busy(self, activity: str) -> None:
        now = self._clock()
        self._phase = (now, activity)
        self.heartbeat.beat(now)

    def idle(self) -> None:
        self._phase = None
        self.heartbeat.rest()

    # ---------------------------------------------------------------- decision
    def stalled_for(self, now: float) -> float:
        """How long the current phase has lasted at `now`; 0 when idle."""
        phase = self._phase
        return 0.0 if phase is None else max(now - phase[0], 0.0)

    def check(self, now: float) -> tuple[str, float] | None:
        """(activity, seconds) of a phase that has lasted `timeout_s` at `now`, else None."""
        phase = self._phase
        if phase is None or now - phase[0] < self.timeout_s:
            return None
        return phase[1], now - phase[0]

    # ---------------------------------------------------------------- thread
    def start(self) -> Watchdog:
        self._thread = threading.Thread(target=self._run, name="sglite-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        warned: tuple[float, str] | None = None
        while not self._stop.wait(self.poll_s):
            now = self._clock()
            expired = self.check(now)
            if expired is not None:
                self.on_timeout(*expired)
                return
            phase = self._phase
            if phase is not None and phase is not warned:
                if now - phase[0] >= stall_threshold(self.timeout_s):
                    warned = phase
                    logger.warning(
                        "the scheduler has been in %r for %.0f s; /health reports unhealthy "
                        "and the watchdog stops the server at %g s (--watchdog-timeout)",
                        phase[1], now - phase[0], self.timeout_s,
                    )  # fmt: skip

    def exit_process(self, activity: str, stalled_s: float) -> None:
        """The default `on_timeout`: say what was running, dump every thread, exit."""
        logger.error(
            "watchdog: the scheduler has been in %r for %.1f s, longer than "
            "--watchdog-timeout %g s; the stacks of all its threads follow; exiting with "
            "code %d",
            activity, stalled_s, self.timeout_s, WATCHDOG_EXIT_CODE,
        )  # fmt: skip
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(WATCHDOG_EXIT_CODE)
