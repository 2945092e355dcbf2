"""Workers run a ForwardInput and return one sampled token per row; the client overlaps them.

- `Worker` is the interface: `run(fi) -> np.ndarray[int64]`. `ModelWorker` (model_worker.py)
  runs the real model; `NullWorker` returns fixed tokens instantly (scheduler benchmarks).
- `WorkerClient` owns the future buffer. In the normal loop it runs each batch inline. In the
  overlap loop it runs batches on one background thread, in launch order, so the scheduler
  prepares batch N+1 and processes the result of N-1 while batch N computes. Batch N+1 gets
  the tokens of batch N through future references resolved on the worker thread: the sampled
  tokens never make a round trip through the scheduler first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from sglite.scheduler.batch import ForwardInput

FUTURE_BUFFER_SIZE = 1 << 18


class Worker(ABC):
    @abstractmethod
    def run(self, fi: ForwardInput) -> np.ndarray:
        """Forward + sample; input ids are already resolved (no future references)."""

    def release(self, rids: list[str]) -> None:  # noqa: B027 - optional hook
        """Requests that finished or were retracted (drop per-request state)."""


class NullWorker(Worker):
    """A model that answers instantly: token (position * 7 + row) % vocab for every row."""

    def __init__(self, vocab_size: int = 32000):
        self.vocab_size = vocab_size

    def run(self, fi: ForwardInput) -> np.ndarray:
        return (fi.seq_lens * 7 + fi.rows) % self.vocab_size


class WorkerClient:
    def __init__(self, worker: Worker, overlap: bool):
        self.worker = worker
        self.overlap = overlap
        self._future = np.zeros(FUTURE_BUFFER_SIZE, dtype=np.int64)
        self._next_slot = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sglite-worker") if overlap else None

    def future_slots(self, n: int) -> np.ndarray:
        slots = (self._next_slot + np.arange(n)) % FUTURE_BUFFER_SIZE
        self._next_slot = (self._next_slot + n) % FUTURE_BUFFER_SIZE
        return slots

    def launch(self, fi: ForwardInput) -> Future:
        if self._pool is not None:
            return self._pool.submit(self._run, fi)
        done: Future = Future()
        try:
            done.set_result(self._run(fi))
        except BaseException as e:  # surfaced by result(), like the threaded path
            done.set_exception(e)
        return done

    def _run(self, fi: ForwardInput) -> np.ndarray:
        ids = fi.input_ids
        refs = np.flatnonzero(ids < 0)
        if len(refs):
            ids = ids.copy()
            ids[refs] = self._future[-ids[refs] - 1]
            fi.input_ids = ids
            self._extend_penalty_context(fi, refs)
        tokens = np.asarray(self.worker.run(fi), dtype=np.int64)
        self._future[fi.future_slots] = tokens
        return tokens

    @staticmethod
    def _extend_penalty_context(fi: ForwardInput, refs: np.ndarray) -> None:
        """A resolved future input is also the newest output token of that row."""
        if not any(p is not None for p in fi.penalty_tokens):
            return
        starts = np.concatenate([[0], np.cumsum(fi.seq_lens - fi.prefix_lens)[:-1]])
        row_of = {int(s): i for i, s in enumerate(starts)}
        for pos in refs.tolist():
            i = row_of.get(pos)
            ctx = fi.penalty_tokens[i] if i is not None else None
            if ctx is not None:
                fi.penalty_tokens[i] = (ctx[0], ctx[1] + [int(fi.input_ids[pos])])

    def release(self, rids: list[str]) -> None:
        if rids:
            if self._pool is not None:
                self._pool.submit(self.worker.release, rids)
            else:
                self.worker.release(rids)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
