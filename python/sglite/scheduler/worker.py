"""Workers run a ForwardInput and return one sampled token per row; the client overlaps them.

- `Worker` is the interface: `run(fi) -> np.ndarray[int64]`. `ModelWorker` (model_worker.py)
  runs the real model; `NullWorker` returns fixed tokens instantly (scheduler benchmarks).
- `WorkerClient` owns the future buffer. In the normal loop it runs each batch inline. In the
  overlap loop it runs batches on one background thread, in launch order, so the scheduler
  prepares batch N+1 and processes the result of N-1 while batch N computes. Batch N+1 gets
  the tokens of batch N through future references resolved on the worker thread: the sampled
  tokens never make a round trip through the scheduler first.
- The future buffer is a `FutureMap`, chosen by the worker (`Worker.future_map`): on the host
  (`HostFutureMap`, numpy; the default) a batch runs to completion on the worker thread. A
  CUDA `ModelWorker` keeps it on the device instead (`model_worker.DeviceFutureMap`): the
  worker thread only enqueues the batch and the tokens reach the host later, so `launch`
  returns a `Launched` whose `result()` waits for them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np

from sglite.logprobs import RowLogprobs
from sglite.scheduler.batch import ForwardInput

FUTURE_BUFFER_SIZE = 1 << 18


class Tokens(Protocol):
    """The sampled tokens of one batch, maybe still on their way to the host, and the
    log-probs its rows asked for (`ForwardInput.logprob_specs`; None when none did)."""

    logprobs: list[RowLogprobs | None] | None

    def wait(self) -> np.ndarray:
        """Block until the tokens are on the host; np.int64 [B]."""
        ...


class FutureMap(ABC):
    """The sampled token of every launched row by future slot, and how a batch runs over it.

    `run(worker, fi)` is called on the thread that runs batches, in launch order: resolve
    fi's future references (`-(slot + 1)`) from earlier batches, run the batch, store its
    tokens at `fi.future_slots`, return them.
    """

    @abstractmethod
    def run(self, worker: Worker, fi: ForwardInput) -> Tokens: ...


class Worker(ABC):
    @abstractmethod
    def run(self, fi: ForwardInput) -> np.ndarray:
        """Forward + sample; input ids are already resolved (no future references)."""

    def run_step(self, fi: ForwardInput) -> tuple[np.ndarray, list[RowLogprobs | None] | None]:
        """`run`, plus the log-probs the rows asked for (default: none computed)."""
        return self.run(fi), None

    def release(self, rids: list[str]) -> None:  # noqa: B027 - optional hook
        """Requests that finished or were retracted (drop per-request state)."""

    def future_map(self, size: int) -> FutureMap:
        """Where this worker's batches find the tokens of earlier ones (default: host)."""
        return HostFutureMap(size)


class NullWorker(Worker):
    """A model that answers instantly: token (position * 7 + row) % vocab for every row."""

    def __init__(self, vocab_size: int = 32000):
        self.vocab_size = vocab_size

    def run(self, fi: ForwardInput) -> np.ndarray:
        return (fi.seq_lens * 7 + fi.rows) % self.vocab_size


class Ready:
    """Tokens already on the host."""

    def __init__(self, tokens: np.ndarray, logprobs: list[RowLogprobs | None] | None = None):
        self.tokens = tokens
        self.logprobs = logprobs

    def wait(self) -> np.ndarray:
        return self.tokens


class HostFutureMap(FutureMap):
    """numpy future buffer; each batch runs to completion before the next one starts."""

    def __init__(self, size: int):
        self.tokens = np.zeros(size, dtype=np.int64)

    def run(self, worker: Worker, fi: ForwardInput) -> Ready:
        refs = np.flatnonzero(fi.input_ids < 0)
        if len(refs):
            resolve_refs_on_host(fi, refs, self.tokens[-fi.input_ids[refs] - 1])
        tokens, logprobs = worker.run_step(fi)
        tokens = np.asarray(tokens, dtype=np.int64)
        self.tokens[fi.future_slots] = tokens
        return Ready(tokens, logprobs)


def resolve_refs_on_host(fi: ForwardInput, refs: np.ndarray, values: np.ndarray) -> None:
    """Replace the future references at positions `refs` of fi.input_ids by `values`."""
    ids = fi.input_ids.copy()
    ids[refs] = values
    fi.input_ids = ids
    _extend_penalty_context(fi, refs)


def uses_penalties(fi: ForwardInput) -> bool:
    return any(p is not None for p in fi.penalty_tokens)


def _extend_penalty_context(fi: ForwardInput, refs: np.ndarray) -> None:
    """A resolved future input is also the newest output token of that row."""
    if not uses_penalties(fi):
        return
    starts = np.concatenate([[0], np.cumsum(fi.seq_lens - fi.prefix_lens)[:-1]])
    row_of = {int(s): i for i, s in enumerate(starts)}
    for pos in refs.tolist():
        i = row_of.get(pos)
        ctx = fi.penalty_tokens[i] if i is not None else None
        if ctx is not None:
            fi.penalty_tokens[i] = (ctx[0], ctx[1] + [int(fi.input_ids[pos])])


class Launched:
    """One launched batch: `result()` blocks until its sampled tokens (np.int64 [B]) are on
    the host, then `logprobs` holds the batch's log-probs (None when no row asked). `job`
    runs the batch (inline, or on the worker thread) and yields `Tokens`."""

    def __init__(self, job: Future):
        self._job = job
        self.logprobs: list[RowLogprobs | None] | None = None

    def result(self) -> np.ndarray:
        tokens = self._job.result()
        out = tokens.wait()
        self.logprobs = tokens.logprobs
        return out


class WorkerClient:
    def __init__(self, worker: Worker, overlap: bool):
        self.worker = worker
        self.overlap = overlap
        self.futures = worker.future_map(FUTURE_BUFFER_SIZE)
        self._next_slot = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sglite-worker") if overlap else None

    def future_slots(self, n: int) -> np.ndarray:
        slots = (self._next_slot + np.arange(n)) % FUTURE_BUFFER_SIZE
        self._next_slot = (self._next_slot + n) % FUTURE_BUFFER_SIZE
        return slots

    def launch(self, fi: ForwardInput) -> Launched:
        if self._pool is not None:
            return Launched(self._pool.submit(self.futures.run, self.worker, fi))
        job: Future = Future()
        try:
            job.set_result(self.futures.run(self.worker, fi))
        except BaseException as e:  # surfaced by result(), like the threaded path
            job.set_exception(e)
        return Launched(job)

    def release(self, rids: list[str]) -> None:
        if rids:
            if self._pool is not None:
                self._pool.submit(self.worker.release, rids)
            else:
                self.worker.release(rids)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
