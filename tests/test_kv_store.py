"""The native K/V writes into the CPU pool (rust/attn/src/store.rs via
`sglite.layers.cpu_ops.kv_store`, used by `KVPool.set_kv`): the stored bytes equal torch's
saturate-and-convert plus `index_copy_` (`kv_dtype.to_store`, `copy_rows`) bit for bit, for
every pool dtype, from float32 and bfloat16 rows, strided rows (V as a slice of the fused
QKV output), over values that probe each rounding case; bad slots raise and write nothing."""

from __future__ import annotations

import pytest
import torch

from sglite.layers import cpu_ops
from sglite.mem_cache.kv_dtype import copy_rows, to_store
from sglite.mem_cache.memory_pool import KVPool

pytestmark = pytest.mark.skipif(cpu_ops._native() is None, reason="native module missing")

POOL_DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


def _probe_values(n: int, seed: int) -> torch.Tensor:
    """Random f32 bit patterns (every exponent, NaNs and infinities included), values around
    each format's subnormal/normal boundary and finite max, and exact ties of each format."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int64)
    anything = bits.to(torch.int32).view(torch.float32)
    scales = 2.0 ** torch.randint(-20, 18, (n,), generator=gen).float()
    near = torch.randn(n, generator=gen) * scales
    ties = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        grid = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        if dtype == torch.bfloat16:
            grid = torch.randint(0, 2**16, (512,), generator=gen).to(torch.int16)
            vals = grid.view(torch.bfloat16).float()
        else:
            vals = grid.view(dtype).float()
        vals = vals[torch.isfinite(vals)].sort().values
        ties.append((vals[1:] + vals[:-1]) / 2)  # midpoints: exact ties (f32 holds them)
    special = torch.tensor(
        [0.0, -0.0, 448.0, -448.0, 464.0, 480.0, 1e6, -1e6, 57344.0, 61440.0, 2.0**-9,
         2.0**-10, 3 * 2.0**-11, 2.0**-16, 2.0**-17, 1e-40, -1e-45, float("inf"),
         float("-inf"), float("nan"), -float("nan"), 3.3895314e38, -3.4028235e38]
    )  # fmt: skip
    return torch.cat([anything, near, *ties, special])


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_kv_store_writes_torchs_bytes(pool_dtype, src_dtype):
    heads, dim = 4, 16
    values = _probe_values(40_000, seed=7).to(src_dtype)
    tokens = values.numel() // (heads * dim)
    rows = values[: tokens * heads * dim].reshape(tokens, heads, dim)
    slots = tokens + 9
    loc = torch.randperm(slots)[:tokens]
    want = torch.zeros(slots, heads, dim, dtype=pool_dtype)
    copy_rows(want, loc, to_store(rows, pool_dtype))
    got = torch.zeros(slots, heads, dim, dtype=pool_dtype)
    assert cpu_ops.kv_store(got, loc, rows) is True
    w, g = (t.view(torch.uint8) if t.element_size() == 1 else t for t in (want, got))
    if pool_dtype in (torch.float32, torch.bfloat16):  # NaN payloads aside, the same bits
        view = torch.int32 if pool_dtype == torch.float32 else torch.int16
        same = (w.view(view) == g.view(view)) | (w.isnan() & g.isnan())
    else:
        same = w == g
    bad = (~same).nonzero()
    assert bad.numel() == 0, (
        f"{bad.shape[0]} differ, first at {bad[0].tolist()}: {rows.reshape(-1)[0].item()!r}"
    )


def test_strided_rows_and_the_pool_path():
    """V is a column slice of the fused QKV output: rows `width` apart; `KVPool.set_kv`
    stores what the torch path stores."""
    torch.manual_seed(0)
    heads, dim, tokens = 2, 8, 5
    qkv = torch.randn(tokens, 3 * heads * dim) * 100
    v = qkv[:, 2 * heads * dim :].view(tokens, heads, dim)
    k = qkv[:, heads * dim : 2 * heads * dim].reshape(tokens, heads, dim) * 3
    assert v.stride(0) == 3 * heads * dim
    for dtype in POOL_DTYPES:
        pool = KVPool(16, 1, 2, heads, dim, dtype, "cpu")
        loc = torch.tensor([3, 1, 7, 12, 9])
        pool.set_kv(1, loc, k, v)
        for buf, rows in ((pool.k_buffer[1], k), (pool.v_buffer[1], v)):
            want = torch.zeros_like(buf)
            copy_rows(want, loc, to_store(rows, dtype))
            assert torch.equal(buf.view(torch.uint8), want.view(torch.uint8)), dtype
        assert not pool.k_buffer[0].view(torch.uint8).any()  # other layers untouched


def test_bad_slots_raise_and_write_nothing():
    buf = torch.zeros(8, 2, 4, dtype=torch.float8_e4m3fn)
    rows = torch.ones(2, 2, 4)
    for loc in (torch.tensor([1, 8]), torch.tensor([-1, 2])):
        with pytest.raises(ValueError, match="outside the pool"):
            cpu_ops.kv_store(buf, loc, rows)
        assert not buf.view(torch.uint8).any()


def test_layouts_it_does_not_take_fall_back():
    buf = torch.zeros(8, 2, 4)
    rows = torch.ones(2, 4, 2).transpose(1, 2)  # heads not contiguous
    assert cpu_ops.kv_store(buf, torch.tensor([0, 1]), rows) is None
    assert (
        cpu_ops.kv_store(buf, torch.tensor([0, 1], dtype=torch.int32), torch.ones(2, 2, 4)) is None
    )
    assert (
        cpu_ops.kv_store(buf.to(torch.float16), torch.tensor([0, 1]), torch.ones(2, 2, 4)) is None
    )
