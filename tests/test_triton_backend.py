"""TritonAttnBackend gives torch_native's results: layer level (extend, mixed, decode, page
sizes 1 and 16, GQA) under the Triton interpreter, at small sizes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("sglite_kernels") is None:  # source checkout, not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

from sglite.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from sglite.attention.triton_backend import TritonAttnBackend  # noqa: E402
from sglite.mem_cache.memory_pool import KVPool, ReqToTokenPool  # noqa: E402
from sglite.model_executor.forward_batch import ForwardBatch  # noqa: E402
from sglite_kernels import interpreted  # noqa: E402

NUM_KV_HEADS, HEAD_DIM = 2, 32


@pytest.fixture(autouse=True)
def _cpu_cases_need_the_interpreter(request):
    if request.node.get_closest_marker("gpu") is None and not interpreted():
        pytest.skip("CPU triton-backend cases need Triton's interpreter, off under SGL_TEST_GPU=1")


LAYER = SimpleNamespace(
    layer_id=1, num_heads=8, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, scaling=0.17
)


class World:
    """Pools with a few requests whose prefixes are cached; slots handed out page by page."""

    def __init__(self, page_size: int, prefix_lens: list[int], dtype=torch.float32):
        gen = torch.Generator().manual_seed(page_size)
        self.gen, self.dtype, self.page_size = gen, dtype, page_size
        self.kv_pool = KVPool(512, page_size, 2, NUM_KV_HEADS, HEAD_DIM, dtype, "cpu")
        for buf in self.kv_pool.k_buffer + self.kv_pool.v_buffer:
            buf.copy_(torch.randn(buf.shape, generator=gen))
        self.table = ReqToTokenPool(8, 256, "cpu")
        self.rows = self.table.alloc(len(prefix_lens))[::-1]  # rows not in batch order
        num_pages = 512 // page_size
        self.free_pages = (torch.randperm(num_pages, generator=gen) + 1).tolist()
        self.slots = [[] for _ in prefix_lens]
        for i, n in enumerate(prefix_lens):
            self.table.write(self.rows[i], 0, self.grow(i, n))

    def grow(self, i: int, n: int) -> list[int]:
        """n more slots for request i: the rest of its last page, then fresh pages."""
        new = []
        for _ in range(n):
            if len(self.slots[i]) % self.page_size == 0:
                self.slots[i].append(self.free_pages.pop() * self.page_size)
            else:
                self.slots[i].append(self.slots[i][-1] + 1)
            new.append(self.slots[i][-1])
        return new

    def extend_batch(self, extend_lens: list[int], mixed: bool = False) -> ForwardBatch:
        prefix = [len(s) for s in self.slots]
        loc = []
        for i, n in enumerate(extend_lens):
            new = self.grow(i, n)
            self.table.write(self.rows[i], prefix[i], new)
            loc += new
        ids = [[0] * n for n in extend_lens]
        return ForwardBatch.extend(
            input_ids=ids, prefix_lens=prefix, req_pool_indices=self.rows, out_cache_loc=loc,
            req_to_token_pool=self.table, kv_pool=self.kv_pool, mixed=mixed,
        )  # fmt: skip

    def decode_batch(self) -> ForwardBatch:
        loc = []
        for i, row in enumerate(self.rows):
            new = self.grow(i, 1)
            self.table.write(row, len(self.slots[i]) - 1, new)
            loc += new
        return ForwardBatch.decode(
            input_ids=[0] * len(self.rows), seq_lens=[len(s) for s in self.slots],
            req_pool_indices=self.rows, out_cache_loc=loc,
            req_to_token_pool=self.table, kv_pool=self.kv_pool,
        )  # fmt: skip

    def qkv(self, num_tokens: int):
        def rand(*shape):
            return torch.randn(*shape, generator=self.gen).to(self.dtype)

        return (
            rand(num_tokens, LAYER.num_heads, HEAD_DIM),
            rand(num_tokens, NUM_KV_HEADS, HEAD_DIM),
            rand(num_tokens, NUM_KV_HEADS, HEAD_DIM),
        )


def _run_both(world: World, batch: ForwardBatch):
    """Run save_kv + forward with each backend on its own copy of the K/V buffers."""
    q, k, v = world.qkv(batch.num_tokens)
    pool = world.kv_pool
    start_k = [b.clone() for b in pool.k_buffer]
    start_v = [b.clone() for b in pool.v_buffer]
    outs, bufs = [], []
    for backend in (TorchNativeAttnBackend(None), TritonAttnBackend(None)):
        for dst, src in zip(pool.k_buffer + pool.v_buffer, start_k + start_v):
            dst.copy_(src)
        backend.init_forward_metadata(batch)
        backend.save_kv(LAYER, batch, k, v)
        outs.append(backend.forward(q, k, v, LAYER, batch))
        bufs.append([b.clone() for b in pool.k_buffer + pool.v_buffer])
    for a, b in zip(*bufs):
        assert torch.equal(a, b)
    return outs


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_then_decode_matches_torch_native(page_size):
    world = World(page_size, prefix_lens=[0, 13, 20])
    ref, got = _run_both(world, world.extend_batch([9, 4, 1]))
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    for _ in range(2):
        ref, got = _run_both(world, world.decode_batch())
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


def test_mixed_batch_bf16_matches_torch_native():
    world = World(16, prefix_lens=[30, 0, 5], dtype=torch.bfloat16)
    ref, got = _run_both(world, world.extend_batch([1, 12, 1], mixed=True))
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)


# ---------------------------------------------------------------- model runner


@pytest.mark.parametrize("page_size", [1, 16])
def test_runner_greedy_tokens_match_torch_native(tiny_runner, page_size):
    """Same greedy tokens (and close logits) from a tiny Qwen3 (GQA) with either backend,
    on scrambled slots: ragged prompts, a request sharing a cached prefix, a mixed batch."""
    from fixtures.model_driver import Driver, fragment_allocator

    prompts = [[5, 9, 23, 7, 11] * 4, [17, 3, 40], [8] * 33]
    results = {}
    for backend in ("torch_native", "triton"):
        runner = tiny_runner("qwen3", page_size=page_size, attention_backend=backend)
        fragment_allocator(runner.allocator, seed=page_size)
        drv = Driver(runner)
        seqs = [drv.new_seq() for _ in prompts]
        tokens = drv.greedy(seqs, prompts, steps=6)
        # A new request reusing the first 16 cached tokens of seq 0, extended in a mixed
        # batch next to a decode row of seq 1.
        shared = drv.new_seq(seqs[0], prefix_len=16)
        logits = drv.extend([shared, seqs[1]], [[4, 4, 2, 9], [tokens[1][-1]]], mixed=True)
        results[backend] = (tokens, logits)
    ref_tokens, ref_logits = results["torch_native"]
    got_tokens, got_logits = results["triton"]
    assert got_tokens == ref_tokens
    torch.testing.assert_close(got_logits, ref_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runner_greedy_tokens_match_torch_native_cuda(tiny_runner):
    """The compiled kernels on CUDA (fp32, exact dots) give torch_native's greedy tokens."""
    from fixtures.model_driver import Driver, fragment_allocator

    prompts = [[5, 9, 23, 7, 11] * 40, [17, 3, 40], [8] * 333]
    tokens = {}
    for backend in ("torch_native", "triton"):
        runner = tiny_runner(
            "qwen3", page_size=16, attention_backend=backend, device="cuda", dtype="float32"
        )
        fragment_allocator(runner.allocator, seed=0)
        drv = Driver(runner)
        tokens[backend] = drv.greedy([drv.new_seq() for _ in prompts], prompts, steps=8)
    assert tokens["triton"] == tokens["torch_native"]
