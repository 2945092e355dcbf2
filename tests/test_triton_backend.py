"""TritonAttnBackend gives torch_native's results: layer level (extend, mixed, decode, page
sizes 1 and 16, GQA) under the Triton interpreter, at small sizes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("sglite_kernels") is None:  # source checkout, not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

from fixtures.attn_world import LAYER, World  # noqa: E402
from sglite.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from sglite.attention.triton_backend import TritonAttnBackend  # noqa: E402
from sglite.model_executor.forward_batch import ForwardBatch  # noqa: E402
from sglite_kernels import interpreted  # noqa: E402


@pytest.fixture(autouse=True)
def _cpu_cases_need_the_interpreter(request):
    if request.node.get_closest_marker("gpu") is None and not interpreted():
        pytest.skip("CPU triton-backend cases need Triton's interpreter, off under SGL_TEST_GPU=1")


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
