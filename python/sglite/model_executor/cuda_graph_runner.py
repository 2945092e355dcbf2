"""CudaGraphRunner: decode forwards captured once per batch size at start-up, then replayed.

At start-up (`ModelRunner` on CUDA, unless `--disable-cuda-graph`) one graph is captured for
each batch size of `capture_batch_sizes(max_bs)`: 1, 2, 4, 8, then steps of 8 up to max_bs
(rounded up to a multiple of 8). Every graph reads the same static input buffers, sized for
the largest one; the attention backend's metadata lives in fixed-size buffers too (see the
CUDA graph hooks of `attention/base.py`). All graphs share one memory pool; the largest is
captured first so that the smaller ones fit in what it left.

A decode batch of `n <= max_bs` requests replays the graph of the next captured size
`bs >= n` (`padded_batch_size`): its tensors are copied into the first n rows of the static
buffers, and rows n..bs-1 are padding that writes and reads only the reserved targets:

| buffer           | rows 0..n-1 (real)       | rows n..bs-1 (padding)            |
|------------------|--------------------------|-----------------------------------|
| input_ids        | the batch's tokens       | 0                                 |
| positions        | seq_len - 1              | 0                                 |
| seq_lens         | the batch's lengths      | 1                                 |
| req_pool_indices | the batch's rows         | 0 (row 0 of req_to_token: slot 0) |
| out_cache_loc    | the batch's new slots    | 0 (KV slot 0, never handed out)   |

Replay returns the first n rows of the graph's logits: a view into the graph's memory,
valid until the next replay on the same stream (the sampler consumes it right away). Extend
and mixed batches, and decode batches above max_bs, run eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch

from sglite.model_executor.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from sglite.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_CUDA_GRAPH_MAX_BS = 160
WARMUP_RUNS = 2  # eager runs before each capture: compile kernels, create library handles


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8, up to the first of them that is >= max_bs."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    ladder = [1, 2, 4, 8, *range(16, max_bs + 8, 8)]
    return [bs for bs in ladder if bs < max_bs] + [next(bs for bs in ladder if bs >= max_bs)]


def padded_batch_size(num_reqs: int, batch_sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_reqs rows, or None when none does."""
    i = bisect.bisect_left(batch_sizes, num_reqs)
    return batch_sizes[i] if num_reqs >= 1 and i < len(batch_sizes) else None


def default_cuda_graph_max_bs(max_running_requests: int) -> int:
    return min(DEFAULT_CUDA_GRAPH_MAX_BS, max_running_requests)


class NoCudaGraphs:
    """The runner's graph runner where graphs are off (CPU, --disable-cuda-graph)."""

    batch_sizes: list[int] = []
    num_replays = 0

    def can_run(self, batch: ForwardBatch) -> bool:
        return False

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        raise RuntimeError("CUDA graphs are disabled")


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner, max_bs: int) -> None:
        self.runner = runner
        self.model = runner.model
        self.backend = runner.attn_backend
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.num_replays = 0
        device = runner.device
        with torch.inference_mode():
            self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
            self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
            self.seq_lens = torch.ones(self.max_bs, dtype=torch.int64, device=device)
            self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
            self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.backend.init_cuda_graph_state(self.max_bs)
        self.batches: dict[int, ForwardBatch] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._pool = None
        self._stream = None
        self.capture()

    # ---------------------------------------------------------------- capture
    def capture(self) -> None:
        start = time.perf_counter()
        sizes = sorted(self.batch_sizes, reverse=True)
        logger.info(
            "capturing CUDA graphs for decode: %d batch sizes up to %d", len(sizes), self.max_bs
        )
        with torch.inference_mode():
            for i, bs in enumerate(sizes, 1):
                batch = self.batches[bs] = self._static_batch(bs)
                self._load_padding(0, bs)
                self.backend.init_forward_metadata_capture(batch)
                self.graphs[bs], self.outputs[bs] = self._capture_one(batch)
                if i % 8 == 0 or i == len(sizes):
                    logger.info("CUDA graph capture: %d/%d (bs %d)", i, len(sizes), bs)
        logger.info("captured %d CUDA graphs in %.1f s", len(sizes), time.perf_counter() - start)

    def _static_batch(self, bs: int) -> ForwardBatch:
        """A decode batch over the first bs rows of the static buffers. Its host lengths are
        placeholders: inside a graph only the device tensors are read."""
        r = self.runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=[1] * bs,
            req_pool_indices=self.req_pool_indices[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_to_token_pool=r.req_to_token_pool,
            kv_pool=r.kv_pool,
            attn_backend=self.backend,
        )

    def _run_model(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch.input_ids, batch.positions, batch)

    def _capture_one(self, batch: ForwardBatch) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream, then capture one forward of the (all-padding) batch."""
        if self._stream is None:  # created here, not in __init__: the class imports on CPU
            self._stream = torch.cuda.Stream(self.runner.device)
            self._pool = torch.cuda.graph_pool_handle()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                self._run_model(batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            out = self._run_model(batch)
        return graph, out

    # ---------------------------------------------------------------- replay
    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.forward_mode.is_decode() and 1 <= batch.batch_size <= self.max_bs

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits `[n, vocab]` of a decode batch of n rows (see the module docstring)."""
        n = batch.batch_size
        bs = padded_batch_size(n, self.batch_sizes)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.req_pool_indices[:n].copy_(batch.req_pool_indices)
        self.out_cache_loc[:n].copy_(batch.out_cache_loc)
        self._load_padding(n, bs)
        static = self.batches[bs]
        self.backend.init_forward_metadata_replay(static, n)
        self.graphs[bs].replay()
        self.num_replays += 1
        return self.outputs[bs][:n]

    def _load_padding(self, start: int, end: int) -> None:
        """Rows start..end-1 become padding rows (a larger batch may have left real data)."""
        if start < end:
            self.input_ids[start:end].zero_()
            self.positions[start:end].zero_()
            self.seq_lens[start:end].fill_(1)
            self.req_pool_indices[start:end].zero_()
            self.out_cache_loc[start:end].zero_()
