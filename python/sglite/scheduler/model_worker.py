"""ModelWorker: runs a ForwardInput on the ModelRunner (forward + sample) for the scheduler.

A batch runs in two halves: `prepare` copies the host arrays to the device (the mirrored
table rows, the ForwardBatch, the SamplingBatchInfo) and `forward_sample` runs the model and
the sampler. On CPU `run` does both and returns numpy tokens.

On CUDA the future buffer lives on the device (`DeviceFutureMap`), so that the tokens
sampled by batch N feed batch N+1 without a host round trip. Streams of the thread that runs
batches (the worker thread in the overlap loop):
- its current (default) stream does only `prepare`'s host-to-device copies. Those copies
  are blocking, but they wait for nothing else: no compute is queued on that stream.
- a stream of its own runs everything else, in launch order: it waits for the copies,
  writes the table rows, resolves future references with a device gather, runs the forward
  (a CUDA graph replay for decode) and the sampler, stores the tokens in the future buffer,
  and copies them into pinned host memory without blocking; an event marks the end.
The thread returns as soon as the batch is enqueued (`DeviceTokens`); the scheduler's
`result()` waits on the event. The staged tensors were allocated on the default stream but
are read by the forward stream, so `DeviceTokens` keeps them alive until that event.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sglite.constrained.mask import fill_vocab_mask
from sglite.logprobs import RowLogprobs, RowLogprobSpec, compute_logprobs, logits_rows
from sglite.model_executor.forward_batch import ForwardBatch
from sglite.model_executor.sampler import SamplingBatchInfo
from sglite.scheduler.batch import ForwardInput, Mode
from sglite.scheduler.worker import (
    FutureMap,
    Worker,
    resolve_refs_on_host,
    uses_penalties,
)


@dataclass(eq=False)
class Prepared:
    """One batch on the device, before its forward."""

    batch: ForwardBatch
    info: SamplingBatchInfo
    table_rows: torch.Tensor | None = None  # [n, width] contents of the request rows
    rows: torch.Tensor | None = None  # [n] the rows they go to
    logprob_specs: list[RowLogprobSpec | None] | None = None
    logprobs: list[RowLogprobs | None] | None = None  # set by forward_sample


class ModelWorker(Worker):
    def __init__(self, runner, seed: int = 0):
        self.runner = runner
        self.vocab_size = runner.model_config.vocab_size
        self.eos_token_ids = tuple(runner.model_config.eos_token_ids)
        torch.manual_seed(seed)  # requests without a seed draw from torch's RNG

    def run(self, fi: ForwardInput) -> np.ndarray:
        return self.run_step(fi)[0]

    def run_step(self, fi: ForwardInput) -> tuple[np.ndarray, list | None]:
        p = self.prepare(fi)
        tokens = self.forward_sample(p).cpu().numpy()
        return tokens, p.logprobs

    def future_map(self, size: int) -> FutureMap:
        if self.runner.device.type == "cuda":
            return DeviceFutureMap(self.runner.device, size)
        return super().future_map(size)

    def prepare(self, fi: ForwardInput) -> Prepared:
        """Copy the batch to the device. Future references stay negative in the ids."""
        r = self.runner
        pool = r.req_to_token_pool
        if fi.mode == Mode.DECODE:
            batch = ForwardBatch.decode(
                input_ids=fi.input_ids,
                seq_lens=fi.seq_lens,
                req_pool_indices=fi.rows,
                out_cache_loc=fi.out_cache_loc,
                req_to_token_pool=pool,
                kv_pool=r.kv_pool,
            )
        else:
            lens = fi.seq_lens - fi.prefix_lens
            batch = ForwardBatch.extend(
                input_ids=np.split(fi.input_ids, np.cumsum(lens)[:-1]),
                prefix_lens=fi.prefix_lens,
                req_pool_indices=fi.rows,
                out_cache_loc=fi.out_cache_loc,
                req_to_token_pool=pool,
                kv_pool=r.kv_pool,
                mixed=fi.mode == Mode.MIXED,
            )
        info = SamplingBatchInfo.build(
            fi.sampling_params,
            vocab_size=self.vocab_size,
            device=r.device,
            output_ids=[p[1] if p is not None else () for p in fi.penalty_tokens],
            output_lens=np.maximum(fi.seq_lens - fi.prompt_lens, 0).tolist(),
            prompt_ids=[p[0] if p is not None else () for p in fi.penalty_tokens],
            eos_token_ids=self.eos_token_ids,
            # under TP only rank 0 samples (ModelRunner.sample): the others need no mask
            vocab_mask=fill_vocab_mask(fi.vocab_mask, self.vocab_size, r.device)
            if r.tp_rank == 0
            else None,
        )
        prepared = Prepared(batch, info)
        if fi.logprob_specs:
            prepared.logprob_specs = fi.logprob_specs
            rows = logits_rows(fi.logprob_specs, fi.prefix_lens, fi.seq_lens)
            if rows is not None:
                batch.logits_index = torch.from_numpy(rows).to(r.device)
        if fi.table_rows is not None:  # the scheduler's host table is mirrored on the device
            prepared.table_rows = torch.from_numpy(fi.table_rows).to(r.device)
            prepared.rows = torch.from_numpy(fi.rows).to(r.device)
        return prepared

    def forward_sample(self, p: Prepared) -> torch.Tensor:
        """Write the table rows, run the forward and sample: `[B]` int64 on the device."""
        if p.table_rows is not None:
            table = self.runner.req_to_token_pool.req_to_token
            table[p.rows, : p.table_rows.shape[1]] = p.table_rows
        logits = self.runner.forward(p.batch)
        if p.logprob_specs is None:
            return self.runner.sample(logits, p.info)
        # the sampler may mask its logits in place: log-probs read the raw ones
        bs = len(p.logprob_specs)
        tokens = self.runner.sample(logits[:bs].clone(), p.info)
        with torch.inference_mode():
            p.logprobs = compute_logprobs(logits, tokens, p.logprob_specs)
        return tokens


class DeviceTokens:
    """Tokens on their way to pinned host memory; `wait()` blocks on the batch's event."""

    def __init__(
        self, host: torch.Tensor, done: torch.cuda.Event | None, keepalive: tuple, logprobs=None
    ):
        self.host = host
        self.done = done
        self.keepalive: tuple | None = keepalive
        self.logprobs = logprobs  # computed on the host already (a batch that asked waited)

    @classmethod
    def copy_to_host(
        cls, tokens: torch.Tensor, stream, keepalive: tuple, logprobs=None
    ) -> DeviceTokens:
        """Start the copy on `stream` (the current one), without blocking."""
        if stream is None:  # CPU (tests): the tokens are on the host already
            return cls(tokens.clone(), None, keepalive, logprobs)
        host = torch.empty(tokens.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        return cls(host, done, keepalive, logprobs)

    def wait(self) -> np.ndarray:
        if self.done is not None:
            self.done.synchronize()
        self.keepalive = None  # the forward stream is past every use of the staged tensors
        return self.host.numpy()


class DeviceFutureMap(FutureMap):
    """The future buffer as a device tensor; batches run on their own stream (see above).

    ModelWorker uses it on CUDA only. On CPU (tests of the resolution logic) there are no
    streams or events: `torch.cuda.stream(None)` is a no-op."""

    def __init__(self, device: torch.device | str, size: int):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        with torch.inference_mode():
            self.tokens = torch.zeros(size, dtype=torch.int64, device=self.device)

    def run(self, worker: ModelWorker, fi: ForwardInput) -> DeviceTokens:
        refs = np.flatnonzero(fi.input_ids < 0)
        if len(refs) and uses_penalties(fi):
            # Penalties count output tokens on the host: wait for the referenced ones (rare).
            with torch.inference_mode(), torch.cuda.stream(self.stream):
                slots = torch.from_numpy(-fi.input_ids[refs] - 1).to(self.device)
                resolve_refs_on_host(fi, refs, self.tokens[slots].cpu().numpy())
            refs = refs[:0]
        with torch.inference_mode():
            p = worker.prepare(fi)
            staged_ids = p.batch.input_ids
            future_slots = torch.from_numpy(fi.future_slots).to(self.device)
            if self.stream is not None:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                if len(refs):
                    past = self.tokens[(-1 - staged_ids).clamp_(min=0)]
                    p.batch.input_ids = torch.where(staged_ids < 0, past, staged_ids)
                tokens = worker.forward_sample(p)
                self.tokens[future_slots] = tokens
                # Keep alive what prepare staged on the default stream: the forward reads it.
                keep = (p, staged_ids, future_slots)
                return DeviceTokens.copy_to_host(tokens, self.stream, keep, p.logprobs)
