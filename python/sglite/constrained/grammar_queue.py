"""GrammarQueue: the scheduler's grammar gate (constrained requests wait here for their grammar)
and the cache of compiled grammars.

A request with a grammar enters this queue instead of the waiting queue; its grammar compiles
on a small thread pool. `poll()`, called by the scheduler before it forms a batch, hands back
the requests whose grammar is ready (each with a fresh matcher in `req.grammar`, for the
waiting queue) and those that cannot run: the grammar is invalid (400 with the backend's
message) or took longer than `timeout_s` (503). Unconstrained requests never pass through here.

Compiles are cached by key `(kind, text)`, errors included, in an LRU of futures bounded by
count and by the bytes the compiled grammars hold (`backend.compiled_bytes`): a second request
with the same grammar shares the first one's compile, finished or not. A request whose own
deadline passed while its compile still runs gets a 503 and the compile lands in the cache, so
a retry can find it there; a compile stopped at its deadline (CompileTimeout) or one whose
process died is not cached (a retry compiles again, under the same limits).

Under tensor parallelism every rank compiles too (its matchers decide when a request
finishes), but which requests leave the queue depends on time (a compile done or not yet,
a deadline passed), so rank 0 decides: `agree` gives every rank rank 0's verdicts, and a
rank told "ready" waits for its own compile of the same grammar.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglite.constrained.base import GrammarBackend, GrammarError, GrammarKey
from sglite.constrained.compile_process import CompileCrashed, CompileTimeout

if TYPE_CHECKING:
    from sglite.scheduler.req import Req

NUM_COMPILE_THREADS = 2
CACHE_SIZE = 256  # compiled grammars kept (least recently used first out)
CACHE_BYTES = 256 << 20  # and at most this much memory held by them
IDLE_WAIT_S = 0.005  # the longest an idle scheduler sleeps in wait() before it polls again
READY = 0  # the verdict of a request whose grammar compiled


@dataclass
class Refusal:
    """A request that leaves the queue without its grammar."""

    req: Req
    status_code: int
    message: str


@dataclass
class _Waiting:
    req: Req
    key: GrammarKey
    compiled: Future
    deadline: float


class GrammarQueue:
    def __init__(
        self,
        backend: GrammarBackend,
        timeout_s: float,
        *,
        num_threads: int = NUM_COMPILE_THREADS,
        cache_size: int = CACHE_SIZE,
        cache_bytes: int = CACHE_BYTES,
        clock: Callable[[], float] = time.monotonic,
        agree: Callable[[dict], dict] | None = None,
    ):
        self.backend = backend
        self.agree = agree or (lambda verdicts: verdicts)
        self.timeout_s = timeout_s
        self.num_threads = num_threads
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.clock = clock
        self.cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self.num_cache_hits = 0
        self.num_compiles = 0
        self._queue: list[_Waiting] = []
        self._landed = threading.Event()  # a compile finished since the last wait()
        self._pool: ThreadPoolExecutor | None = None  # started by the first compile

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, req: Req) -> None:
        """Queue `req` (its sampling params name a grammar) until its grammar is compiled."""
        key = req.sampling_params.grammar_key
        assert key is not None, "only constrained requests wait for a grammar"
        self._queue.append(_Waiting(req, key, self._compiled(key), self.clock() + self.timeout_s))

    def poll(self) -> tuple[list[Req], list[Refusal]]:
        """(requests whose grammar is ready, in arrival order; requests refused)."""
        if not self._queue:
            return [], []
        verdicts = self.agree(self._verdicts(self.clock()))
        ready: list[Req] = []
        refused: list[Refusal] = []
        still: list[_Waiting] = []
        for w in self._queue:
            verdict = verdicts.get(w.req.rid)
            if verdict is None:
                still.append(w)
            elif verdict[0] == READY:
                try:
                    w.req.grammar = self.backend.matcher(w.compiled.result())
                    ready.append(w.req)
                except Exception as e:  # rank 0's compile of the same grammar worked
                    refused.append(Refusal(w.req, 500, f"{w.key[0]}: {e}"))
            else:
                refused.append(Refusal(w.req, *verdict))
        self._queue = still
        return ready, refused

    def _verdicts(self, now: float) -> dict[str, tuple[int, str]]:
        """rid -> (READY, "") or (status code, message) for each request that leaves now."""
        out: dict[str, tuple[int, str]] = {}
        landed = False
        for w in self._queue:
            if w.compiled.done():
                landed = True
                error = w.compiled.exception()
                if error is None:
                    out[w.req.rid] = (READY, "")
                elif isinstance(error, GrammarError):
                    out[w.req.rid] = (400, str(error))
                elif isinstance(error, CompileTimeout):
                    out[w.req.rid] = (503, str(error))
                    self._forget(w)
                else:
                    out[w.req.rid] = (500, f"{w.key[0]}: the grammar failed to compile: {error}")
                    if isinstance(error, CompileCrashed):
                        self._forget(w)
            elif now >= w.deadline:
                out[w.req.rid] = (
                    503,
                    f"{w.key[0]}: the grammar did not compile within {self.timeout_s:g} s "
                    "(--grammar-compile-timeout); it is still compiling, retry later",
                )
        if landed:
            self._evict()
        return out

    def _forget(self, w: _Waiting) -> None:
        """Drop a compile that was stopped or crashed from the cache: a retry compiles anew."""
        if self.cache.get(w.key) is w.compiled:
            del self.cache[w.key]

    def remove(self, hit: Callable[[Req], bool]) -> list[Req]:
        """Take the waiting requests that `hit` selects out of the queue (aborts)."""
        gone = [w.req for w in self._queue if hit(w.req)]
        if gone:
            self._queue = [w for w in self._queue if not hit(w.req)]
        return gone

    def wait(self, timeout_s: float = IDLE_WAIT_S) -> None:
        """Block until a compile finishes (or `timeout_s`): the scheduler has nothing else to do."""
        self._landed.wait(timeout_s)
        self._landed.clear()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.backend.shutdown()

    def _compiled(self, key: GrammarKey) -> Future:
        future = self.cache.get(key)
        if future is not None:
            self.cache.move_to_end(key)
            self.num_cache_hits += 1
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="sglite-grammar")
        self.num_compiles += 1
        future = self._pool.submit(self.backend.compile, key)
        future.add_done_callback(lambda _: self._landed.set())
        self.cache[key] = future
        self._evict()
        return future

    def _evict(self) -> None:
        """Drop the least recently used finished compiles beyond the cache's count or bytes
        (a request that holds one keeps it alive until it got its matcher)."""
        done = [(k, f) for k, f in self.cache.items() if f.done()]
        sizes = {k: self._bytes(f) for k, f in done}
        excess, held = len(self.cache) - self.cache_size, sum(sizes.values())
        for key, _ in done:
            if excess <= 0 and held <= self.cache_bytes:
                break
            del self.cache[key]
            excess -= 1
            held -= sizes[key]

    def _bytes(self, future: Future) -> int:
        if future.exception() is not None:
            return 0
        return self.backend.compiled_bytes(future.result())

    def stats(self) -> dict[str, Any]:
        return {
            "num_grammar_waiting_reqs": len(self._queue),
            "num_grammar_compiles": self.num_compiles,
            "num_grammar_cache_hits": self.num_cache_hits,
        }
