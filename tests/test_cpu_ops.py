"""The native element-wise kernels of the CPU path (rust/attn/src/ops.rs via
sglite.layers.cpu_ops) against torch's ops on random shapes, fp32 and bf16, one to three
threads, rows large enough to be split; the layers use them and still compute what torch
computes; and a layout the kernels do not take falls back instead of failing."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from sglite.layers import cpu_ops
from sglite.layers.activation import GatedActivation, SiluAndMul
from sglite.layers.layernorm import RMSNorm
from sglite.layers.rotary_embedding import RotaryEmbedding

pytestmark = pytest.mark.skipif(cpu_ops._native() is None, reason="native module missing")

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
# bf16: the kernels and torch round at the same steps, but may differ by one ulp (sum order)
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rows=st.sampled_from([1, 3, 16, 200]),
    dim=st.sampled_from([8, 20, 576]),
    dtype=DTYPES,
    with_residual=st.booleans(),
    threads=st.integers(1, 3),
)
def test_rms_norm_matches_torch(seed, rows, dim, dtype, with_residual, threads):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, dim, generator=gen).to(dtype)
    weight = torch.randn(dim, generator=gen).to(dtype)
    summed = x + residual if with_residual else x
    want = F.rms_norm(summed.float(), (dim,), None, 1e-5).to(dtype) * weight
    res = residual.clone() if with_residual else None
    with _threads(threads):
        got = cpu_ops.rms_norm(x, weight, 1e-5, res)
    if with_residual:
        assert torch.equal(res, summed), "the residual holds x + residual"
    torch.testing.assert_close(got, want, **TOL[dtype])


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rows=st.sampled_from([1, 5, 64]),
    d=st.sampled_from([4, 17, 1536]),
    dtype=DTYPES,
    threads=st.integers(1, 3),
    gelu=st.booleans(),
)
def test_gated_activations_match_torch(seed, rows, d, dtype, threads, gelu):
    gen = torch.Generator().manual_seed(seed)
    # wide range: exp must neither overflow for large negative gates nor lose small ones
    x = (torch.randn(rows, 2 * d, generator=gen) * 20).to(dtype)
    if gelu:  # GeGLU, Gemma's gelu_pytorch_tanh
        want, kernel = F.gelu(x[:, :d], approximate="tanh") * x[:, d:], cpu_ops.gelu_tanh_and_mul
    else:
        want, kernel = F.silu(x[:, :d]) * x[:, d:], cpu_ops.silu_and_mul
    with _threads(threads):
        got = kernel(x)
    torch.testing.assert_close(got, want, **TOL[dtype])


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    tokens=st.sampled_from([1, 4, 300]),
    heads=st.sampled_from([(9, 3), (4, 4), (2, 1)]),
    head_dim=st.sampled_from([8, 64, 128]),
    dtype=DTYPES,
    fused=st.booleans(),
    threads=st.integers(1, 3),
)
def test_rope_matches_torch(seed, tokens, heads, head_dim, dtype, fused, threads):
    gen = torch.Generator().manual_seed(seed)
    hq, hk = heads
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, dtype=dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    if fused:  # q and k as views of one QKV projection, rows (hq + 2 hk) heads apart
        qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=gen).to(dtype)
        q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
        q, k = q.view(tokens, hq, head_dim), k.view(tokens, hk, head_dim)
    else:
        q = torch.randn(tokens, hq, head_dim, generator=gen).to(dtype)
        k = torch.randn(tokens, hk, head_dim, generator=gen).to(dtype)
    cos_sin = rope.cos_sin.index_select(0, positions).unsqueeze(1)
    cos, sin = cos_sin.split(head_dim, dim=-1)
    want_q, want_k = rope._rotate(q, cos, sin), rope._rotate(k, cos, sin)
    with _threads(threads):
        got_q, got_k = cpu_ops.rope(positions, q, k, rope.cos_sin)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])


def test_layers_take_the_native_path_and_agree_with_the_definition():
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(32, 1e-6)
    norm.weight.data.copy_(torch.randn(32, generator=gen))
    x, residual = torch.randn(5, 32, generator=gen), torch.randn(5, 32, generator=gen)
    summed = x + residual
    want = summed / summed.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * norm.weight
    out, new_residual = norm(x, residual)
    # the native path adds into the caller's residual; torch's would return a new tensor
    assert new_residual is residual
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(new_residual, summed)
    rope = RotaryEmbedding(8, 64, 10000.0)
    q, k = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 1, 8, generator=gen)
    assert cpu_ops.rope(torch.tensor([0, 5, 63]), q, k, rope.cos_sin) is not None
    gate_up = torch.randn(3, 16, generator=gen)
    assert cpu_ops.silu_and_mul(gate_up) is not None
    assert cpu_ops.gelu_tanh_and_mul(gate_up) is not None
    torch.testing.assert_close(
        SiluAndMul()(gate_up), gate_up[:, :8] * torch.sigmoid(gate_up[:, :8]) * gate_up[:, 8:]
    )
    gelu = F.gelu(gate_up[:, :8], approximate="tanh") * gate_up[:, 8:]
    for name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):  # one function, one kernel
        torch.testing.assert_close(GatedActivation(name)(gate_up), gelu)


def test_layouts_it_does_not_take_fall_back():
    x = torch.randn(4, 8)
    assert cpu_ops.rms_norm(x.t(), torch.ones(4), 1e-6) is None  # not contiguous
    assert cpu_ops.rms_norm(x.double(), torch.ones(8).double(), 1e-6) is None  # dtype
    assert cpu_ops.rms_norm(x, torch.ones(8), 1e-6, torch.randn(2, 8)) is None  # shapes
    assert cpu_ops.silu_and_mul(torch.randn(3, 5)) is None  # odd width
    table = torch.randn(10, 16)
    q = torch.randn(2, 4, 8)
    assert cpu_ops.rope(torch.tensor([1, 2], dtype=torch.int32), q, q, table) is None
    assert cpu_ops.rope(torch.tensor([1, 2]), q.transpose(1, 2), q, table) is None
    # the layers still compute the right thing on a layout the kernels refuse
    norm = RMSNorm(4, 1e-6)
    assert torch.allclose(norm(x.t()), F.rms_norm(x.t(), (4,), None, 1e-6))


def test_bad_sizes_raise_instead_of_writing():
    core = cpu_ops._native()
    x, out = torch.zeros(4, 8), torch.zeros(4, 8)
    raw = cpu_ops._raw
    with pytest.raises(ValueError, match="rows of the weight"):
        core.rms_norm(raw(x), None, raw(torch.ones(3)), raw(out), 1e-6, "float32", 1)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        core.gated_mul(raw(x), raw(out), 4, "silu", "float16", 1)
    with pytest.raises(ValueError, match="must be"):
        core.gated_mul(raw(x), raw(out), 4, "silu", "float32", 1)
    with pytest.raises(ValueError, match="not silu or gelu_tanh"):
        core.gated_mul(raw(x), raw(out), 4, "relu", "float32", 1)
    table = torch.zeros(10, 16)
    with pytest.raises(ValueError, match="outside the table"):
        pos = torch.tensor([3, 10])
        q = torch.zeros(2, 1, 8)
        core.rope(
            raw(pos),
            raw(table),
            raw(q),
            8,
            1,
            raw(q),
            8,
            1,
            raw(q.clone()),
            raw(q.clone()),
            8,
            "float32",
            1,
        )
