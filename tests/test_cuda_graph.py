"""Decode CUDA graphs and the device-side token handoff of the overlap loop.

CPU: the captured batch sizes and padding arithmetic; the graph runner's static buffers,
padding and the triton backend's capture/replay metadata hooks (also with sliding-window
layers), with each "graph" replayed as an eager run of the captured batch (Triton
interpreter); the device future buffer's
resolution logic (device gather, penalties, mixed batches) on CPU tensors.
GPU (`gpu` marker, skipped without CUDA): graph replay equals eager for padded and exact
batch sizes in fp32 and bf16 (logits, and each path's own K/V writes from the same state),
and both loops with graphs give the greedy tokens of an eager (no-graph) run.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import sglite.core
from fixtures.model_driver import Driver
from sglite.config import ServerArgs
from sglite.messages import GenerateReq
from sglite.model_executor.cuda_graph_runner import (
    CudaGraphRunner,
    NoCudaGraphs,
    capture_batch_sizes,
    default_cuda_graph_max_bs,
    padded_batch_size,
)
from sglite.sampling_params import SamplingParams
from sglite.scheduler.model_worker import DeviceFutureMap, ModelWorker
from sglite.scheduler.scheduler import Scheduler
from sglite.scheduler.worker import HostFutureMap

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


# ---------------------------------------------------------------- batch sizes (pure)


@pytest.mark.parametrize(
    "max_bs,expected",
    [
        (1, [1]),
        (3, [1, 2, 4]),
        (8, [1, 2, 4, 8]),
        (9, [1, 2, 4, 8, 16]),
        (20, [1, 2, 4, 8, 16, 24]),
        (40, [1, 2, 4, 8, 16, 24, 32, 40]),
    ],
)
def test_capture_batch_sizes(max_bs, expected):
    assert capture_batch_sizes(max_bs) == expected


@pytest.mark.parametrize("max_bs", [1, 2, 5, 8, 13, 64, 160, 161, 256])
def test_every_batch_pads_to_the_smallest_captured_size(max_bs):
    sizes = capture_batch_sizes(max_bs)
    assert sizes == sorted(set(sizes)) and sizes[-1] >= max_bs and sizes[-1] - max_bs < 8
    assert all(b - a <= 8 for a, b in zip(sizes, sizes[1:]))
    for n in range(1, sizes[-1] + 1):
        bs = padded_batch_size(n, sizes)
        assert bs in sizes and bs >= n
        assert all(s < n for s in sizes if s < bs)
    assert padded_batch_size(0, sizes) is None
    assert padded_batch_size(sizes[-1] + 1, sizes) is None


def test_default_max_bs_and_validation():
    assert default_cuda_graph_max_bs(4096) == 160
    assert default_cuda_graph_max_bs(24) == 24
    with pytest.raises(ValueError, match="cuda_graph_max_bs must be >= 1"):
        capture_batch_sizes(0)


# ---------------------------------------------------------------- graph runner (CPU)


class _EagerGraph:
    """Stands in for a CUDA graph on CPU: replay re-runs the captured batch eagerly, with the
    attention metadata bound at capture (as a real graph keeps its buffers' addresses)."""

    def __init__(self, owner: CudaGraphRunner, batch):
        self.owner, self.batch = owner, batch
        self.meta = owner.backend._meta
        self.out = owner._run_model(batch).clone()

    def replay(self) -> None:
        self.owner.backend._meta = self.meta
        self.out.copy_(self.owner._run_model(self.batch))


class _GraphWithoutKVWrites(_EagerGraph):
    """A broken graph: the right logits, but its K/V writes are lost."""

    def replay(self) -> None:
        bufs = _kv_buffers(self.owner.runner.kv_pool)
        before = [b.clone() for b in bufs]
        super().replay()
        for b, old in zip(bufs, before):
            b.copy_(old)


class EagerGraphRunner(CudaGraphRunner):
    graph_cls = _EagerGraph

    def _capture_one(self, batch):
        graph = self.graph_cls(self, batch)
        return graph, graph.out


class BrokenGraphRunner(EagerGraphRunner):
    graph_cls = _GraphWithoutKVWrites


def _kv_buffers(pool) -> list[torch.Tensor]:
    return pool.k_buffer + pool.v_buffer


def _eager_forward(runner, batch) -> torch.Tensor:
    batch.attn_backend = runner.attn_backend
    with torch.inference_mode():
        runner.attn_backend.init_forward_metadata(batch)
        return runner.model(batch.input_ids, batch.positions, batch).clone()


def _decode_batch(drv: Driver, seqs, next_ids):
    """Driver.decode without the forward: allocate, write the rows, build the batch."""
    from sglite.model_executor.forward_batch import ForwardBatch

    seq_lens = [len(s.ids) + 1 for s in seqs]
    loc = drv.alloc.alloc_decode(seq_lens, [s.slots[-1] for s in seqs])
    for s, t, slot in zip(seqs, next_ids, loc.tolist()):
        drv.table.write(s.row, len(s.ids), [slot])
        s.slots.append(slot)
        s.ids.append(t)
    return ForwardBatch.decode(
        input_ids=next_ids, seq_lens=seq_lens, req_pool_indices=[s.row for s in seqs],
        out_cache_loc=loc, req_to_token_pool=drv.table, kv_pool=drv.runner.kv_pool,
    )  # fmt: skip


def _compare_graph_and_eager(runner, subsets, atol, check_tokens=True):
    """Prefill ragged prompts, then decode steps over `subsets` (request counts) where each
    step runs once eagerly and once through the graph runner, each from the same K/V state
    (the pool as it was before the step, the step's new slots empty), so that each run's
    own K/V writes are checked; returns the replay count."""
    rng = random.Random(0)
    vocab = runner.model_config.vocab_size
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 40))] for _ in range(max(subsets))
    ]
    drv = Driver(runner)
    seqs = [drv.new_seq() for _ in prompts]
    next_ids = drv.extend(seqs, prompts).argmax(-1).tolist()
    start = runner.graph_runner.num_replays
    bufs = _kv_buffers(runner.kv_pool)
    for n in subsets:
        batch = _decode_batch(drv, seqs[:n], next_ids[:n])
        loc = batch.out_cache_loc
        for b in bufs:  # as in a fresh pool
            b[loc] = 0
        before = [b.clone() for b in bufs]
        eager = _eager_forward(runner, batch)
        kv_eager = [b.clone() for b in bufs]
        for b, old in zip(bufs, before):  # in place: the graphs hold these addresses
            b.copy_(old)
        assert runner.graph_runner.can_run(batch)
        graph = runner.forward(batch).clone()
        torch.testing.assert_close(graph, eager, atol=atol, rtol=atol)
        for a, b in zip(kv_eager, bufs):
            assert (a[loc] != 0).flatten(1).any(1).all(), "the eager run left a new slot empty"
            # The graph wrote the same K/V at the real slots, and its padding rows (slot 0)
            # nothing else.
            torch.testing.assert_close(b[1:].float(), a[1:].float(), atol=atol, rtol=atol)
        if check_tokens:
            assert graph.argmax(-1).tolist() == eager.argmax(-1).tolist()
        next_ids[:n] = graph.argmax(-1).tolist()
    return runner.graph_runner.num_replays - start


def test_padded_replay_matches_eager_cpu(tiny_runner):
    """Static buffers, padding rows and the triton metadata hooks, replayed eagerly on CPU."""
    from sglite_kernels import interpreted

    if not interpreted():
        pytest.skip("the CPU triton backend needs Triton's interpreter (off: SGL_TEST_GPU=1)")
    runner = tiny_runner("qwen3", attention_backend="triton")
    runner.graph_runner = EagerGraphRunner(runner, 8)
    assert runner.graph_runner.batch_sizes == [1, 2, 4, 8]
    replays = _compare_graph_and_eager(runner, [5, 3, 8, 1, 2, 7], atol=1e-5)
    assert replays == 6
    # Above the largest captured size the runner declines (the forward runs eagerly).
    nine = dataclasses.replace(runner.graph_runner._static_batch(8), seq_lens_cpu=[1] * 9)
    assert not runner.graph_runner.can_run(nine)


def test_padded_replay_with_sliding_windows_matches_eager_cpu(tiny_model_dir):
    """A model with full and windowed layers (a tiny Qwen2: full, sliding 8, sliding 8):
    the graph buffers hold each window's decode split counts, refilled at every replay."""
    from sglite.model_executor.model_runner import ModelRunner
    from sglite_kernels import interpreted

    if not interpreted():
        pytest.skip("the CPU triton backend needs Triton's interpreter (off: SGL_TEST_GPU=1)")
    path = tiny_model_dir("qwen2", sliding_window=8, max_window_layers=1, num_hidden_layers=3)
    runner = ModelRunner(
        path, device="cpu", max_total_tokens=2048, max_running_requests=16,
        attention_backend="triton",
    )  # fmt: skip
    runner.graph_runner = EagerGraphRunner(runner, 4)
    assert set(runner.attn_backend._graph.num_kv_splits) == {None, 8}
    assert _compare_graph_and_eager(runner, [3, 4, 1], atol=1e-5) == 3


def test_comparison_catches_a_graph_that_writes_no_kv(tiny_runner):
    """The check above can fail: a graph with the right logits whose K/V writes are lost
    (which a comparison after the eager run's writes would not notice)."""
    from sglite_kernels import interpreted

    if not interpreted():
        pytest.skip("the CPU triton backend needs Triton's interpreter (off: SGL_TEST_GPU=1)")
    runner = tiny_runner("qwen3", attention_backend="triton")
    runner.graph_runner = BrokenGraphRunner(runner, 4)
    with pytest.raises(AssertionError, match="not close"):
        _compare_graph_and_eager(runner, [3], atol=1e-5)


# ---------------------------------------------------------------- device future buffer


def _workload(vocab: int, n: int = 12):
    rng = random.Random(1)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 60))]
        penalties = {"frequency_penalty": 0.7, "repetition_penalty": 1.3} if i % 4 == 1 else {}
        sp = SamplingParams(max_new_tokens=rng.randrange(4, 24), temperature=0, **penalties)
        reqs.append((f"r{i}", prompt, sp))
    return reqs


def _run_scheduler(runner, reqs, *, overlap: bool, worker: ModelWorker | None = None):
    # At most 4 running: a request admitted when another finishes comes in a mixed batch
    # right after a decode batch, so its decode rows reference tokens still in flight.
    args = ServerArgs(max_total_tokens=runner.max_total_num_tokens, chunked_prefill_size=32,
                      enable_mixed_chunk=True, max_running_requests=4,
                      disable_overlap_schedule=not overlap)  # fmt: skip
    outputs: list = []
    sched = Scheduler(
        args, worker or ModelWorker(runner), core=sglite.core.load("python"),
        allocator=runner.allocator, req_to_token_pool=runner.req_to_token_pool,
        context_length=runner.model_config.context_length, eos_token_ids=set(),
        decode_tail=lambda ids: "", send=outputs.append,
    )  # fmt: skip
    for rid, prompt, sp in reqs:
        sched.add_request(GenerateReq(rid, prompt, sp))
    sched.run_until_idle()
    sched.client.shutdown()
    got: dict[str, list[int]] = {}
    for msg in outputs:
        for rid, ids in zip(msg.rids, msg.output_ids):
            got.setdefault(rid, []).extend(ids)
    assert [len(got[rid]) for rid, _, _ in reqs] == [sp.max_new_tokens for _, _, sp in reqs]
    return got, sched


class _CountingDeviceMap(DeviceFutureMap):
    def __init__(self, device, size):
        super().__init__(device, size)
        self.resolved = {"decode": 0, "mixed": 0, "extend": 0}

    def run(self, worker, fi):
        if (fi.input_ids < 0).any():
            self.resolved[fi.mode.value] += 1
        return super().run(worker, fi)


class _DeviceMapWorker(ModelWorker):
    """ModelWorker with the device future buffer even on CPU (no streams there)."""

    def future_map(self, size: int):
        self.map = _CountingDeviceMap(self.runner.device, size)
        return self.map


def test_device_future_map_matches_host_on_cpu(tiny_runner):
    """Future references resolved by a device gather (decode and mixed batches, penalties
    through the host path) give the host buffer's greedy tokens, in both loops."""
    runner = tiny_runner("llama")
    reqs = _workload(runner.model_config.vocab_size)
    expected, sched = _run_scheduler(runner, reqs, overlap=True)
    assert isinstance(sched.client.futures, HostFutureMap)
    for overlap in (True, False):
        runner = tiny_runner("llama")
        worker = _DeviceMapWorker(runner)
        got, sched = _run_scheduler(runner, reqs, overlap=overlap, worker=worker)
        assert got == expected
        if overlap:
            assert worker.map.resolved["decode"] > 0 and worker.map.resolved["mixed"] > 0


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "dtype,page_size,atol", [("float32", 1, 1e-4), ("bfloat16", 16, 1e-1)], ids=["fp32", "bf16"]
)
def test_graph_replay_matches_eager_cuda(tiny_runner, dtype, page_size, atol):
    runner = tiny_runner("qwen3", page_size=page_size, device="cuda", dtype=dtype,
                         attention_backend="triton", cuda_graph_max_bs=16)  # fmt: skip
    assert isinstance(runner.graph_runner, CudaGraphRunner)
    assert runner.graph_runner.batch_sizes == [1, 2, 4, 8, 16]
    subsets = [5, 3, 16, 1, 9, 2, 12, 8]  # padded to 8, 4, 16, 1, 16, 2, 16, 8
    replays = _compare_graph_and_eager(runner, subsets, atol, check_tokens=dtype == "float32")
    assert replays == len(subsets)


@pytest.mark.gpu
@needs_cuda
def test_both_loops_with_graphs_match_eager_cuda(tiny_runner):
    """On CUDA the normal and the overlap loop (forward stream, device future buffer, pinned
    copies), decoding through the graphs, give the greedy tokens of an eager run
    (--disable-cuda-graph, normal loop): graph against eager, not graph against graph."""
    kw = dict(device="cuda", dtype="float32", attention_backend="triton", cuda_graph_max_bs=16)
    eager_runner = tiny_runner("qwen3", disable_cuda_graph=True, **kw)
    assert isinstance(eager_runner.graph_runner, NoCudaGraphs)
    reqs = _workload(eager_runner.model_config.vocab_size, n=20)
    expected, _ = _run_scheduler(eager_runner, reqs, overlap=False)
    for overlap in (False, True):
        runner = tiny_runner("qwen3", **kw)
        got, sched = _run_scheduler(runner, reqs, overlap=overlap)
        assert isinstance(sched.client.futures, DeviceFutureMap)
        assert runner.graph_runner.num_replays > 0
        assert got == expected, f"overlap={overlap}"
