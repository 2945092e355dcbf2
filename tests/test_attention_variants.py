"""Every attention backend (torch_native, cpu, triton under Triton's interpreter) computes the
per-layer variations exactly: sliding windows shorter than, equal to and longer than the
sequences, logit soft-caps, attention sinks, and their mix, with GQA (8 query heads over 2
KV heads), against the float64 definition (`fixtures.attn_world.reference`).

Batches: requests extending cached prefixes next to fresh prompts longer than the window
(a windowed prompt runs in pieces), one-token rows of a mixed batch, decode steps after it,
and a prompt prefilled in chunks across the window boundary; page sizes 1 and 16.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fixtures.attn_world import World, layer_with, reference
from sglite.attention.base import AttentionBackend
from sglite.attention.cpu import CpuAttnBackend
from sglite.attention.torch_native import TorchNativeAttnBackend
from sglite.layers.radix_attention import RadixAttention

SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -3.0, 4.0, 0.25])
VARIANTS = {
    "window4": dict(sliding_window=4),  # shorter than every sequence
    "window17": dict(sliding_window=17),  # equal to one, shorter and longer than others
    "window200": dict(sliding_window=200),  # longer than every sequence
    "cap": dict(logit_cap=0.9),
    "sinks": dict(sinks=SINKS),
    "window_cap_sinks": dict(sliding_window=9, logit_cap=2.0, sinks=SINKS),
}


def _backend(name: str, world: World) -> AttentionBackend:
    if name == "triton":
        kernels = pytest.importorskip("sglite_kernels")
        if not kernels.interpreted():
            pytest.skip("CPU triton cases need Triton's interpreter, off under SGL_TEST_GPU=1")
        from sglite.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend(None)
    runner = SimpleNamespace(device=torch.device("cpu"), kv_pool=world.kv_pool)
    return {"torch_native": TorchNativeAttnBackend, "cpu": CpuAttnBackend}[name](runner)


def _check(world: World, batch, backend: AttentionBackend, layer, tol: float = 2e-5) -> None:
    q, k, v = world.qkv(batch.num_tokens)
    q = q * 3  # larger scores, so that a cap changes them visibly
    backend.init_forward_metadata(batch)
    backend.save_kv(layer, batch, k, v)
    got = backend.forward(q, k, v, layer, batch)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), reference(world, q, batch, layer), atol=tol, rtol=tol)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", ["torch_native", "cpu", "triton"])
def test_extend_mixed_then_decode(backend, page_size, variant):
    layer = layer_with(**VARIANTS[variant])
    # prefixes 0, 13, 20, 0: a fresh 70-token prompt (several pieces under a window), an
    # extend over a prefix, a one-token row (mixed), a short fresh prompt
    world = World(page_size, [0, 13, 20, 0])
    attn = _backend(backend, world)
    _check(world, world.extend_batch([70, 4, 1, 9], mixed=True), attn, layer)
    for _ in range(2):
        _check(world, world.decode_batch(), attn, layer)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", ["torch_native", "cpu", "triton"])
def test_chunked_prefill_across_the_window(backend, page_size):
    """One prompt prefilled in chunks of 5, 7, 6 then 1 over a window of 8: each chunk's
    window reaches back into the cached chunks before it, then past them."""
    layer = layer_with(sliding_window=8, sinks=SINKS)
    world = World(page_size, [0, 3])
    attn = _backend(backend, world)
    for chunk in ([5, 2], [7, 9], [6, 1], [1, 12]):
        _check(world, world.extend_batch(chunk), attn, layer)
    _check(world, world.decode_batch(), attn, layer)


@pytest.mark.parametrize("backend", ["torch_native", "cpu", "triton"])
def test_window_of_one_sees_only_itself(backend):
    """W = 1: each token's output is its own value (with no sink and no cap)."""
    layer = layer_with(sliding_window=1)
    world = World(1, [6, 0])
    attn = _backend(backend, world)
    batch = world.extend_batch([3, 4])
    q, k, v = world.qkv(batch.num_tokens)
    attn.init_forward_metadata(batch)
    attn.save_kv(layer, batch, k, v)
    got = attn.forward(q, k, v, layer, batch)
    want = v.repeat_interleave(layer.num_heads // layer.num_kv_heads, dim=1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
def test_bf16_pool_with_every_variant(backend):
    layer = layer_with(sliding_window=9, logit_cap=2.0, sinks=SINKS)
    world = World(16, [30, 0, 5], dtype=torch.bfloat16)
    attn = _backend(backend, world)
    _check(world, world.extend_batch([1, 12, 3], mixed=True), attn, layer, tol=3e-2)
    _check(world, world.decode_batch(), attn, layer, tol=3e-2)


# ---------------------------------------------------------------- the layer and the refusal


def test_radix_attention_validates_its_variant():
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        RadixAttention(4, 16, 0.25, 2, 0, sliding_window=0)
    with pytest.raises(ValueError, match="logit_cap must be a finite number"):
        RadixAttention(4, 16, 0.25, 2, 0, logit_cap=-1.0)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        RadixAttention(4, 16, 0.25, 2, 0, sinks=torch.zeros(2))
    sinks = torch.nn.Parameter(torch.zeros(4))
    layer = RadixAttention(4, 16, 0.25, 2, 3, sliding_window=512, logit_cap=50.0, sinks=sinks)
    assert (layer.sliding_window, layer.logit_cap, layer.sinks) == (512, 50.0, sinks)
    # the model that owns the sinks registers (and loads) them; the layer only refers to them
    assert list(layer.parameters()) == []


def test_a_backend_refuses_a_variant_it_cannot_compute():
    class PlainOnly(TorchNativeAttnBackend):
        features = frozenset({"sliding_window"})

    model = torch.nn.ModuleList(
        [RadixAttention(4, 16, 0.25, 2, 0, sliding_window=8), RadixAttention(4, 16, 0.25, 2, 1)]
    )
    PlainOnly(SimpleNamespace(model=model))  # windows only: accepted
    model.append(RadixAttention(4, 16, 0.25, 2, 2, logit_cap=30.0))
    with pytest.raises(ValueError, match=r"cannot compute logit_cap \(layer 2\)"):
        PlainOnly(SimpleNamespace(model=model))


@pytest.mark.parametrize("window", [None, 7])
def test_written_out_softmax_in_small_chunks(monkeypatch, window):
    """The capped/sink path in query chunks of 3 (each reading only the keys its rows see)
    equals the one-chunk result, causal and windowed."""
    from sglite.attention import attend

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(50, h, 16, generator=gen) for h in (8, 2, 2))
    layer = layer_with(logit_cap=1.2, sinks=SINKS, sliding_window=window)
    mask = None
    if window is not None:  # a fresh 50-token prompt: one windowed piece
        (piece,) = attend.plan_segment(0, 50, window)
        mask = attend.piece_mask(piece, 0, window, "cpu")
    whole = attend.attend_tokens(q, k, v, layer, mask, is_causal=mask is None)
    monkeypatch.setattr(attend, "_MATH_CHUNK_ELEMS", 8 * 50 * 3)
    chunked = attend.attend_tokens(q, k, v, layer, mask, is_causal=mask is None)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
