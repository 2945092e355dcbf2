"""Multi-head latent attention at the layer level: LatentAttention over an MLAKVPool with every
backend (torch_native, cpu, triton under the interpreter) against the definition in float64,
the absorbed decode never up-projecting the context, the MLA pool's layout and bytes, and the
HiCache host and file tiers copying its latent rows exactly.

The definition: token t of a request (position p) attends to positions 0..p of the request;
head h's key at position j is `[W_UK[h] c_j | k_pe_j]` and its value `W_UV[h] c_j`, where
`[c_j | k_pe_j]` is the row the pool holds for j (the new tokens' rows are those given)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from fixtures.attn_world import World
from sglite.attention.cpu import CpuAttnBackend
from sglite.attention.torch_native import TorchNativeAttnBackend
from sglite.layers.latent_attention import LatentAttention, MLASpec
from sglite.mem_cache.file_storage import FileStorage
from sglite.mem_cache.hicache import model_fingerprint
from sglite.mem_cache.host_pool import HostKVPool
from sglite.mem_cache.mla_pool import MLAKVPool, MLALayout

SPEC = MLASpec(kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=24)  # fmt: skip
HEADS, SCALING, LAYER_ID = 4, 0.21, 1
LAYOUT = MLALayout(2, SPEC.kv_lora_rank, SPEC.qk_rope_head_dim, HEADS, SPEC.qk_head_dim,
                   SPEC.v_head_dim)  # fmt: skip


class CountingLinear(nn.Linear):
    """kv_b_proj that records how many latents each call up-projects."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []

    def forward(self, x):
        self.calls.append(x.shape[0])
        return super().forward(x)


def _world(page_size: int, prefix_lens: list[int], dtype=torch.float32) -> World:
    world = World(page_size, prefix_lens, dtype)
    world.kv_pool = MLAKVPool(512, page_size, LAYOUT, dtype, "cpu")
    for buf in world.kv_pool.buffers:
        buf.copy_(torch.randn(buf.shape, generator=world.gen))
    return world


def _layer(dtype=torch.float32, seed=0) -> LatentAttention:
    torch.manual_seed(seed)
    kv_b = CountingLinear(SPEC.kv_lora_rank, HEADS * (SPEC.qk_nope_head_dim + SPEC.v_head_dim),
                          bias=False).to(dtype)  # fmt: skip
    with torch.no_grad():
        kv_b.weight.mul_(3.0)
    return LatentAttention(SPEC, HEADS, SCALING, LAYER_ID, kv_b)


def _inputs(world: World, num_tokens: int):
    def rand(*shape):
        return torch.randn(*shape, generator=world.gen).to(world.dtype)

    return (rand(num_tokens, HEADS, SPEC.qk_nope_head_dim),
            rand(num_tokens, HEADS, SPEC.qk_rope_head_dim),
            rand(num_tokens, SPEC.kv_lora_rank), rand(num_tokens, SPEC.qk_rope_head_dim))  # fmt: skip


def reference(world, layer, batch, inputs) -> torch.Tensor:
    q_nope, q_pe, latent, k_pe = (t.double() for t in inputs)
    rows = world.kv_pool.kv_buffer[LAYER_ID][:, 0].double().clone()
    loc = batch.out_cache_loc
    rows[loc] = torch.cat([latent, k_pe], -1)  # this step's rows, as given
    w = layer.kv_b_proj.weight.double().view(HEADS, SPEC.qk_nope_head_dim + SPEC.v_head_dim, -1)
    w_uk, w_uv = w[:, : SPEC.qk_nope_head_dim], w[:, SPEC.qk_nope_head_dim :]
    if batch.forward_mode.is_decode():
        prefix, ext = [n - 1 for n in batch.seq_lens_cpu], [1] * batch.batch_size
    else:
        prefix, ext = batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu
    out = torch.empty(q_nope.shape[0], HEADS, SPEC.v_head_dim, dtype=torch.float64)
    t = 0
    for i in range(batch.batch_size):
        for j in range(ext[i]):
            keys = rows[world.slots[i][: prefix[i] + j + 1]]
            c, pe = keys[:, : SPEC.kv_lora_rank], keys[:, SPEC.kv_lora_rank :]
            for h in range(HEADS):
                k = torch.cat([c @ w_uk[h].T, pe], -1)
                scores = k @ torch.cat([q_nope[t, h], q_pe[t, h]]) * SCALING
                out[t, h] = torch.softmax(scores, 0) @ (c @ w_uv[h].T)
            t += 1
    return out.view(out.shape[0], -1)


def _run(world, layer, batch, backend):
    inputs = _inputs(world, batch.num_tokens)
    ref = reference(world, layer, batch, inputs)
    backend.init_forward_metadata(batch)
    batch.attn_backend = backend
    layer.kv_b_proj.calls.clear()
    got = layer(*inputs, batch)
    assert got.shape == ref.shape and got.dtype == world.dtype
    return got, ref


def _backends():
    out = [lambda pool: TorchNativeAttnBackend(None),
           lambda pool: CpuAttnBackend(SimpleNamespace(device=torch.device("cpu"), kv_pool=pool))]  # fmt: skip
    return out


def _triton():
    kernels = pytest.importorskip("sglite_kernels")
    if not kernels.interpreted():
        pytest.skip("CPU triton cases need Triton's interpreter, off under SGL_TEST_GPU=1")
    from sglite.attention.triton_backend import TritonAttnBackend

    return TritonAttnBackend(None)


@pytest.mark.parametrize("which", ["torch_native", "cpu"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(4))
def test_extend_mixed_and_decode_match_the_definition(which, page_size, seed):
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    world = _world(page_size, [rng.choice([0, 0, 3, 16, 21]) for _ in range(n)])
    layer = _layer(seed=seed)
    backend = _backends()[["torch_native", "cpu"].index(which)](world.kv_pool)
    extend_lens = [rng.choice([1, 2, 6, 17]) for _ in range(n)]
    mixed = 1 in extend_lens and any(e > 1 for e in extend_lens)
    batch = world.extend_batch(extend_lens, mixed=mixed)
    got, ref = _run(world, layer, batch, backend)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    prefix = batch.extend_prefix_lens_cpu
    # the expanded form up-projects prefix + new latents of the requests with > 1 new token,
    # in one call; one-token requests attend absorbed
    multi = [p + e for p, e in zip(prefix, extend_lens) if e > 1]
    assert layer.kv_b_proj.calls == ([sum(multi)] if multi else [])
    for _ in range(2):
        got, ref = _run(world, layer, world.decode_batch(), backend)
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
        assert layer.kv_b_proj.calls == [], "decode must not up-project the context"


def test_triton_extend_and_decode_match_the_definition():
    backend = _triton()
    world = _world(16, [0, 21, 5])
    layer = _layer(seed=7)
    got, ref = _run(world, layer, world.extend_batch([9, 3, 1], mixed=True), backend)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    for _ in range(2):
        got, ref = _run(world, layer, world.decode_batch(), backend)
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
        assert layer.kv_b_proj.calls == []


def test_bf16_pool_is_close():
    world = _world(16, [12, 0], dtype=torch.bfloat16)
    layer = _layer(torch.bfloat16)
    backend = CpuAttnBackend(SimpleNamespace(device=torch.device("cpu"), kv_pool=world.kv_pool))
    for batch in (world.extend_batch([5, 9]), world.decode_batch()):
        got, ref = _run(world, layer, batch, backend)
        torch.testing.assert_close(got.double(), ref, atol=0.15, rtol=0.05)


def test_triton_kernel_against_torch_at_small_shapes():
    """mla_decode_attention alone: many splits, ragged lengths, a non-power-of-two rope dim."""
    _triton()
    from sglite_kernels import mla_decode_attention

    gen = torch.Generator().manual_seed(3)
    lens, latent, rope, heads = [1, 40, 300], 32, 12, 20
    kv = torch.randn(400, 1, latent + rope, generator=gen)
    slots = [torch.randperm(399, generator=gen)[:n] + 1 for n in lens]
    q = torch.randn(len(lens), heads, latent + rope, generator=gen)
    indptr = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    indices = torch.cat(slots).to(torch.int32)
    o = torch.empty(len(lens), heads, latent)
    splits = torch.tensor([1, 3, 4], dtype=torch.int32)
    mla_decode_attention(q, kv, o, indptr, indices, splits, 4, 0.3, block_n=16)
    for b, s in enumerate(slots):
        keys = kv[s, 0].double()
        weights = torch.softmax(q[b].double() @ keys.T * 0.3, -1)
        torch.testing.assert_close(o[b].double(), weights @ keys[:, :latent], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="one latent row per token"):
        mla_decode_attention(q, kv.view(400, 2, -1), o, indptr, indices, splits, 4, 0.3)


# ---------------------------------------------------------------- the pool


def test_pool_stores_one_latent_row_per_token():
    pool = MLAKVPool(64, 16, LAYOUT, torch.float32, "cpu")
    assert [b.shape for b in pool.buffers] == [(80, 1, 40)] * 2
    assert pool.k_buffer is pool.kv_buffer and pool.values_in_keys
    assert pool.v_buffer[0].data_ptr() == pool.k_buffer[0].data_ptr()
    assert pool.v_buffer[0].shape == (80, 1, 32)
    rows = torch.randn(3, 1, 40)
    pool.set_kv(1, torch.tensor([17, 18, 40]), rows, rows[..., :32])
    assert torch.equal(pool.kv_buffer[1][[17, 18, 40]], rows)
    assert torch.equal(pool.v_buffer[1][17], rows[0, :, :32])
    assert pool.bytes_per_token == 2 * 40 * 4 == LAYOUT.bytes_per_token(torch.float32)
    assert pool.memory_bytes() == 80 * pool.bytes_per_token
    assert LAYOUT.mha_bytes_per_token(torch.float32) == 2 * HEADS * (24 + 24) * 4
    with pytest.raises(ValueError, match="multiple of page_size"):
        MLAKVPool(20, 16, LAYOUT, torch.float32, "cpu")


def test_deepseek_shapes_bytes_per_token():
    v3 = MLALayout(61, 512, 64, 128, 192, 128)
    assert v3.bytes_per_token(torch.bfloat16) == 61 * 1152
    assert v3.mha_bytes_per_token(torch.bfloat16) == 61 * 128 * 320 * 2
    assert "MLA latent 512 + rope 64; MHA would need 4,997,120 B/token" == v3.describe(
        torch.bfloat16
    )


def test_host_tier_copies_the_latent_rows_exactly():
    dev = MLAKVPool(64, 4, LAYOUT, torch.float32, "cpu")
    for b in dev.buffers:
        b.copy_(torch.randn(b.shape))
    host = HostKVPool(dev, 32)
    assert [b.shape for b in host.buffers] == [(36, 1, 40)] * 2
    assert host.bytes_per_slot == dev.bytes_per_token
    host.backup(np.arange(4, 12), np.arange(20, 28))
    expected = [b[4:12].clone() for b in dev.buffers]
    for b in dev.buffers:
        b[4:12] = 0
    host.load(np.arange(20, 28), np.arange(40, 48))
    for b, want in zip(dev.buffers, expected):
        assert torch.equal(b[40:48], want)
    assert host.num_bytes_to_host == host.num_bytes_to_device == 8 * dev.bytes_per_token
    assert [t.shape for t in host.read_pages(np.arange(20, 24))] == [(4, 1, 40)] * 2


def test_file_tier_pages_hold_the_latent_rows(tmp_path):
    pool = MLAKVPool(64, 16, LAYOUT, torch.float32, "cpu")
    fingerprint = model_fingerprint("m", pool)
    assert "mla" in LAYOUT.key(torch.float32)
    st = FileStorage(tmp_path, fingerprint, 64)
    page = [torch.randn(64, 1, 40) for _ in pool.buffers]
    specs = [(b.dtype, (64, *b.shape[1:])) for b in pool.buffers]
    (h,) = st.hashes(np.arange(64), None, [])
    assert st.put(h, page)
    st.flush()
    got = st.get(h, specs)
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got, page))
    st.close()
