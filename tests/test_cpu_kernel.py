"""The native CPU decode-attention kernel (rust/attn via sglite.attention.cpu_kernel) against
a float64 reference on random layouts: head dims with and without a vector-width multiple,
GQA groups, ragged lengths, scattered slots, several threads, fp32 and bf16; and its layout
checks (a bad layout is a ValueError, never a crash)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglite.attention import cpu_kernel, default_backend

pytestmark = pytest.mark.skipif(
    cpu_kernel.unavailable_reason() is not None, reason="native module missing"
)


def _reference(q, k, v, table, rows, seq_lens, scale, window=None, logit_cap=0.0, sinks=None):
    n, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(n):
        first = 0 if window is None else max(0, int(seq_lens[i]) - window)
        slots = table[rows[i], first : seq_lens[i]].long()
        keys, values = k[slots].double(), v[slots].double()
        for h in range(num_heads):
            scores = keys[:, h // group] @ q[i, h].double() * scale
            if logit_cap:
                scores = torch.tanh(scores / logit_cap) * logit_cap
            if sinks is not None:
                scores = torch.cat([scores, sinks[h].double().view(1)])
            weights = torch.softmax(scores, 0)[: len(slots)]
            out[i, h] = weights @ values[:, h // group]
    return out


def _layout(seed, n, num_kv_heads, group, head_dim, max_len, dtype):
    gen = torch.Generator().manual_seed(seed)
    num_slots = n * max_len + 5
    k = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(n, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    table = torch.randint(0, num_slots, (n + 2, max_len), generator=gen, dtype=torch.int32)
    rows = torch.randperm(n + 2, generator=gen)[:n].to(torch.int64)
    seq_lens = torch.randint(1, max_len + 1, (n,), generator=gen, dtype=torch.int64)
    return q, k, v, table, rows, seq_lens


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 9),
    num_kv_heads=st.integers(1, 4),
    group=st.sampled_from([1, 2, 3, 7]),
    head_dim=st.sampled_from([8, 20, 64, 128]),
    max_len=st.sampled_from([1, 3, 40, 700]),
    threads=st.integers(1, 3),
)
def test_matches_the_definition(seed, n, num_kv_heads, group, head_dim, max_len, threads):
    q, k, v, table, rows, seq_lens = _layout(
        seed, n, num_kv_heads, group, head_dim, max_len, torch.float32
    )
    got = cpu_kernel.decode_attention(q, k, v, table, rows, seq_lens, 0.3, threads)
    want = _reference(q, k, v, table, rows, seq_lens, 0.3)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 6),
    group=st.sampled_from([1, 4]),
    head_dim=st.sampled_from([16, 64]),
    max_len=st.sampled_from([1, 9, 300]),
    window=st.one_of(st.none(), st.integers(1, 320)),
    logit_cap=st.sampled_from([0.0, 0.5, 30.0]),
    with_sinks=st.booleans(),
)
def test_window_cap_and_sinks_match_the_definition(
    seed, n, group, head_dim, max_len, window, logit_cap, with_sinks
):
    q, k, v, table, rows, seq_lens = _layout(seed, n, 2, group, head_dim, max_len, torch.float32)
    sinks = torch.linspace(-3, 3, 2 * group) if with_sinks else None
    variant = dict(window=window, logit_cap=logit_cap, sinks=sinks)
    got = cpu_kernel.decode_attention(q, k, v, table, rows, seq_lens, 0.3, 2, **variant)
    want = _reference(q, k, v, table, rows, seq_lens, 0.3, **variant)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_bad_variants_are_value_errors():
    q, k, v, table, rows, seq_lens = _layout(1, 3, 2, 2, 16, 10, torch.float32)
    call = cpu_kernel.decode_attention
    with pytest.raises(ValueError, match="window must be >= 1"):
        call(q, k, v, table, rows, seq_lens, 1.0, window=0)
    with pytest.raises(ValueError, match=r"sinks must be \[4\]"):
        call(q, k, v, table, rows, seq_lens, 1.0, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="logit_cap"):
        call(q, k, v, table, rows, seq_lens, 1.0, logit_cap=float("nan"))


def test_bf16_matches_the_definition_on_the_same_values():
    q, k, v, table, rows, seq_lens = _layout(3, 6, 3, 3, 64, 300, torch.bfloat16)
    got = cpu_kernel.decode_attention(q, k, v, table, rows, seq_lens, 0.125, 2)
    assert got.dtype == torch.bfloat16
    want = _reference(q, k, v, table, rows, seq_lens, 0.125)
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)


def test_bad_layouts_are_value_errors():
    q, k, v, table, rows, seq_lens = _layout(1, 3, 2, 2, 16, 10, torch.float32)
    call = cpu_kernel.decode_attention
    with pytest.raises(ValueError, match="outside the table"):
        call(q, k, v, table, torch.tensor([0, 1, 99]), seq_lens, 1.0)
    with pytest.raises(ValueError, match="seq_len 11"):
        call(q, k, v, table, rows, torch.tensor([1, 11, 2]), 1.0)
    bad = table.clone()
    bad[rows[0], 0] = k.shape[0]
    with pytest.raises(ValueError, match="outside the pool"):
        call(q, k, v, bad, rows, seq_lens, 1.0)
    with pytest.raises(ValueError, match="float32 or all bfloat16"):
        call(q.double(), k, v, table, rows, seq_lens, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        call(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, table, rows, seq_lens, 1.0)
    with pytest.raises(ValueError, match="int32"):
        call(q, k, v, table.long(), rows, seq_lens, 1.0)
    with pytest.raises(ValueError, match="must both be"):
        call(q, k, v, table, rows[:2], seq_lens, 1.0)
    with pytest.raises(ValueError, match="do not fit 2 rows"):
        call(q, k, v, table, rows[:2], seq_lens[:2], 1.0)
    with pytest.raises(ValueError, match="head layout"):
        call(q[:, :3].contiguous(), k, v, table, rows, seq_lens, 1.0)


def test_cpu_is_the_default_backend_on_cpu():
    assert default_backend("cpu") == "cpu"
    assert default_backend("cuda") == "triton"
