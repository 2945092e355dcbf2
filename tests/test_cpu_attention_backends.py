"""The CPU attention backends (torch_native, and cpu: torch_native with the native decode
kernel) against the definition, token by token: each query token of request
i at position p attends, with softmax, to the K/V of positions 0..p of request i read from the
pool (its cached prefix, then this step's tokens), query head h to KV head h // group.

Batches mix every shape the scheduler builds: requests without a cached prefix, requests
extending a cached prefix, one-token rows (the decode rows of a mixed batch), equal and
ragged lengths, page sizes 1 and 16, fp32 and bf16 pools."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from fixtures.attn_world import LAYER, World, reference
from sglite.attention.cpu import CpuAttnBackend
from sglite.attention.torch_native import TorchNativeAttnBackend

BACKENDS = [TorchNativeAttnBackend, CpuAttnBackend]


def _run(world: World, batch, backend_cls) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = world.qkv(batch.num_tokens)
    backend = backend_cls(SimpleNamespace(device=torch.device("cpu"), kv_pool=world.kv_pool))
    backend.init_forward_metadata(batch)
    backend.save_kv(LAYER, batch, k, v)
    got = backend.forward(q, k, v, LAYER, batch)
    assert got.shape == q.shape and got.dtype == q.dtype
    return got, reference(world, q, batch)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(6))
def test_extend_mixed_and_decode_match_the_definition(page_size, seed, backend):
    rng = random.Random(seed)
    n = rng.randint(1, 5)
    prefix_lens = [rng.choice([0, 0, 1, 7, 16, 33]) for _ in range(n)]
    world = World(page_size, prefix_lens)
    # one-token rows (decode rows of a mixed batch) next to longer extends
    extend_lens = [rng.choice([1, 1, 2, 5, 17]) for _ in range(n)]
    mixed = 1 in extend_lens and any(e > 1 for e in extend_lens)
    got, ref = _run(world, world.extend_batch(extend_lens, mixed=mixed), backend)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    for _ in range(2):
        got, ref = _run(world, world.decode_batch(), backend)
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_equal_lengths_and_a_lone_prompt(backend):
    world = World(1, [4, 4])
    got, ref = _run(world, world.extend_batch([3, 3]), backend)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    got, ref = _run(world, world.decode_batch(), backend)  # equal lengths: no mask
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    world = World(16, [0])
    got, ref = _run(world, world.extend_batch([40]), backend)  # causal over this step's K/V only
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_pool(backend):
    world = World(16, [30, 0, 5], dtype=torch.bfloat16)
    got, ref = _run(world, world.extend_batch([1, 12, 3], mixed=True), backend)
    torch.testing.assert_close(got.double(), ref, atol=3e-2, rtol=3e-2)
    for _ in range(2):
        got, ref = _run(world, world.decode_batch(), backend)
        torch.testing.assert_close(got.double(), ref, atol=3e-2, rtol=3e-2)
