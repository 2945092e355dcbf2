"""sglite_kernels against plain torch references.

On CPU the kernels run through the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET),
so these cases are small: a few requests, short ragged sequences, slots allocated page-wise
from a shuffled page list (page sizes 1 and 16), GQA, and small tiles so that several tiles
and splits are crossed. The ``gpu`` cases repeat them at full sizes with bf16 tolerances.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("sglite_kernels") is None:  # source checkout, not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from sglite_kernels import (  # noqa: E402
    decode_attention,
    extend_attention,
    fill_kv_indices,
    interpreted,
    num_kv_splits,
    store_kv,
)

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.fixture(autouse=True)
def _cpu_cases_need_the_interpreter(request):
    if request.node.get_closest_marker("gpu") is None and not interpreted():
        pytest.skip("CPU kernel cases need Triton's interpreter, off under SGL_TEST_GPU=1")


class Pool:
    """K/V buffers whose slots are handed out page by page from a shuffled page list."""

    def __init__(self, num_pages, page_size, num_kv_heads, head_dim, dtype, device, seed=0):
        gen = torch.Generator().manual_seed(seed)
        rows = (num_pages + 1) * page_size  # page 0 is the padding page, never handed out
        shape = (rows, num_kv_heads, head_dim)
        self.k = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
        self.v = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
        self.page_size = page_size
        self.free_pages = (torch.randperm(num_pages, generator=gen) + 1).tolist()

    def alloc(self, num_tokens: int) -> torch.Tensor:
        num_pages = -(-num_tokens // self.page_size)
        pages, self.free_pages = self.free_pages[:num_pages], self.free_pages[num_pages:]
        slots = [p * self.page_size + i for p in pages for i in range(self.page_size)]
        return torch.tensor(slots[:num_tokens], dtype=torch.int64)


def _csr(slot_lists, device, dtype=torch.int32):
    lens = torch.tensor([0] + [len(s) for s in slot_lists])
    indptr = lens.cumsum(0).to(dtype=dtype, device=device)
    indices = torch.cat([s for s in slot_lists] + [torch.zeros(0, dtype=torch.int64)])
    return indptr, indices.to(dtype=dtype, device=device)


def _ref_attention(q, k, v, sm_scale, causal_offset=None, window=None, cap=0.0, sinks=None):
    """q [M, Hq, D], k/v [N, Hkv, D] -> [M, Hq, D] in fp32; query i (at key position
    offset + i; decode: offset N - 1) sees keys n <= offset + i and, under a window W,
    n > offset + i - W; scores capped (cap * tanh(s / cap)); sinks [Hq] in the denominator."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), k) * sm_scale
    if cap:
        scores = torch.tanh(scores / cap) * cap
    offset = k.shape[0] - 1 if causal_offset is None else causal_offset
    m = torch.arange(q.shape[0])[:, None] + offset
    n = torch.arange(k.shape[0])[None, :]
    hidden = n > m
    if window is not None:
        hidden |= n <= m - window
    scores = scores.masked_fill(hidden.to(scores.device), float("-inf"))
    if sinks is not None:
        column = sinks.float().view(-1, 1, 1).expand(-1, q.shape[0], 1)
        weights = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
    else:
        weights = scores.softmax(-1)
    return torch.einsum("hmn,nhd->mhd", weights, v)


# ---------------------------------------------------------------- store_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_scatters_rows(dtype):
    pool = Pool(8, 4, 2, 32, dtype, "cpu")
    before_k, before_v = pool.k.clone(), pool.v.clone()
    qkv = torch.randn(11, (4 + 2 + 2) * 32).to(dtype)  # k/v are strided views of a fused qkv
    k = qkv[:, 4 * 32 : 6 * 32].view(11, 2, 32)
    v = qkv[:, 6 * 32 :].view(11, 2, 32)
    loc = pool.alloc(11)[torch.randperm(11)]
    store_kv(k, v, pool.k, pool.v, loc.to(torch.int32))
    assert torch.equal(pool.k[loc], k) and torch.equal(pool.v[loc], v)
    untouched = torch.ones(pool.k.shape[0], dtype=torch.bool)
    untouched[loc] = False
    assert torch.equal(pool.k[untouched], before_k[untouched])
    assert torch.equal(pool.v[untouched], before_v[untouched])


# ---------------------------------------------------------------- fill_kv_indices


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_fill_kv_indices_flattens_table_rows(table_dtype):
    req_to_token = torch.randint(0, 1000, (6, 700), dtype=table_dtype)
    rows = torch.tensor([4, 1, 5, 2])
    lens = torch.tensor([0, 3, 600, 1])
    kv_indptr = torch.zeros(5, dtype=torch.int64)
    kv_indptr[1:] = lens.cumsum(0)
    kv_indices = torch.full((610,), -1, dtype=torch.int32)
    fill_kv_indices(req_to_token, rows, lens, kv_indptr, kv_indices)
    expected = torch.cat([req_to_token[r, :n] for r, n in zip(rows, lens)])
    assert torch.equal(kv_indices[:604], expected.to(torch.int32))
    assert (kv_indices[604:] == -1).all()


# ---------------------------------------------------------------- decode


def _check_decode(lens, hq, hkv, d, page_size, dtype, device, splits=None, block_n=None, **variant):
    gen = torch.Generator().manual_seed(1)
    pool = Pool(sum(-(-n // page_size) for n in lens) + 2, page_size, hkv, d, dtype, device)
    slots = [pool.alloc(n) for n in lens]
    kv_indptr, kv_indices = _csr(slots, device)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype=dtype, device=device)
    o = torch.full_like(q, float("nan"))
    sm_scale = 1 / math.sqrt(d)
    window = variant.get("window")
    if splits is None:
        max_splits = 8
        lens_read = kv_indptr.diff() if window is None else kv_indptr.diff().clamp(max=window)
        nsplit = num_kv_splits(lens_read, hkv, num_sms=132, max_splits=max_splits)
    else:
        max_splits = max(splits)
        nsplit = torch.tensor(splits, dtype=torch.int32, device=device)
    decode_attention(
        q, pool.k, pool.v, o, kv_indptr, kv_indices, nsplit, max_splits, sm_scale,
        block_n=block_n, **_on(variant, device),
    )  # fmt: skip
    for b, s in enumerate(slots):
        keys, vals = pool.k[s.to(device)], pool.v[s.to(device)]
        ref = _ref_attention(q[b : b + 1], keys, vals, sm_scale, **_ref_variant(variant))
        torch.testing.assert_close(o[b : b + 1].float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (8, 2)])
def test_decode_fp32(page_size, hq, hkv):
    # Split counts 1..3 over tiles of 16: ragged last tiles, and an empty trailing split.
    _check_decode([1, 37, 20], hq, hkv, 32, page_size, torch.float32, "cpu", [1, 3, 3], 16)


def test_decode_bf16_head_dim_64_wide_group():
    _check_decode([9, 30], 8, 1, 64, 16, torch.bfloat16, "cpu", [2, 2], 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_head_dim_128_group_8_default_tiles(dtype):
    # Default tile and the split heuristic (one split at these lengths), 9 ragged requests.
    lens = [1, 2, 3, 63, 64, 65, 100, 129, 250]
    _check_decode(lens, 16, 2, 128, 16, dtype, "cpu")


def test_decode_many_splits_and_heuristic():
    # Lengths past MIN_SPLIT_LEN so the heuristic picks several splits.
    _check_decode([700, 257, 5], 4, 2, 16, 16, torch.float32, "cpu", None, 64)


def test_decode_clamps_bad_split_counts():
    # 0 and counts above max_splits are clamped on the device instead of dropping tokens.
    _check_decode([12, 40], 2, 1, 16, 1, torch.float32, "cpu", [0, 9], 16)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [1, 5, 20, 37, 64])
def test_decode_window(page_size, window):
    # windows shorter than, equal to and longer than the rows; splits of the windowed keys
    _check_decode(
        [1, 37, 20, 50], 8, 2, 32, page_size, torch.float32, "cpu", [1, 3, 2, 3], 16,
        window=window,
    )  # fmt: skip


def test_decode_cap_and_sinks():
    _check_decode([3, 40], 4, 2, 16, 16, torch.float32, "cpu", [1, 3], 16, logit_cap=0.6)
    _check_decode([3, 40], 4, 2, 16, 16, torch.float32, "cpu", [2, 3], 16, sinks=_sinks(4))
    _check_decode(
        [9, 70], 4, 1, 16, 1, torch.float32, "cpu", None, 16,
        window=24, logit_cap=1.5, sinks=_sinks(4),
    )  # fmt: skip


def test_decode_bf16_window_and_sinks():
    _check_decode(
        [9, 30], 8, 1, 64, 16, torch.bfloat16, "cpu", [2, 2], 16, window=12, sinks=_sinks(8)
    )


def test_num_kv_splits_heuristic():
    lens = torch.tensor([1, 255, 256, 257, 4096, 100_000])
    got = num_kv_splits(lens, num_kv_heads=8, num_sms=132, max_splits=16)
    # 6 x 8 = 48 programs per split level; about 4 programs per SM wants 11 splits.
    assert got.dtype == torch.int32
    assert got.tolist() == [1, 1, 1, 2, 11, 11]
    big_batch = num_kv_splits(torch.full((64,), 4096), 8, 132, 16)
    assert big_batch.tolist() == [2] * 64


# ---------------------------------------------------------------- extend


def _on(variant: dict, device) -> dict:
    """The launchers' variant keywords, sinks on the device."""
    if variant.get("sinks") is None:
        return variant
    return {**variant, "sinks": variant["sinks"].to(device)}


def _ref_variant(variant: dict) -> dict:
    return {
        "window": variant.get("window"),
        "cap": variant.get("logit_cap", 0.0),
        "sinks": variant.get("sinks"),
    }


def _sinks(num_heads: int) -> torch.Tensor:
    return torch.linspace(-2.0, 3.0, num_heads)


def _check_extend(
    prefix_lens, extend_lens, hq, hkv, d, page_size, dtype, device, blocks=None, **variant
):
    gen = torch.Generator().manual_seed(2)
    total = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool = Pool(sum(-(-n // page_size) for n in total) + 2, page_size, hkv, d, dtype, device)
    slots = [pool.alloc(n) for n in total]
    prefix_slots = [s[:p] for s, p in zip(slots, prefix_lens)]
    kv_indptr, kv_indices = _csr(prefix_slots, device)
    qo_indptr = torch.tensor([0] + extend_lens).cumsum(0).to(dtype=torch.int64, device=device)
    num_tokens = sum(extend_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    q = rand(num_tokens, hq, d)
    qkv = rand(num_tokens, 2 * hkv * d)  # strided k/v views, as a fused projection yields
    k = qkv[:, : hkv * d].view(num_tokens, hkv, d)
    v = qkv[:, hkv * d :].view(num_tokens, hkv, d)
    o = torch.full_like(q, float("nan"))
    sm_scale = 1 / math.sqrt(d)
    block_m, block_n = blocks or (None, None)
    extend_attention(
        q, k, v, o, pool.k, pool.v, qo_indptr, kv_indptr, kv_indices, max(extend_lens),
        sm_scale, block_m=block_m, block_n=block_n, **_on(variant, device),
    )  # fmt: skip
    for b, (p, s) in enumerate(zip(prefix_lens, prefix_slots)):
        rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        keys = torch.cat([pool.k[s.to(device)], k[rows]])
        vals = torch.cat([pool.v[s.to(device)], v[rows]])
        ref = _ref_attention(q[rows], keys, vals, sm_scale, p, **_ref_variant(variant))
        torch.testing.assert_close(o[rows].float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1)])
def test_extend_fp32(page_size, hq, hkv):
    # No prefix, a prefix with a ragged page, a 1-token extend (a decode row of a mixed batch).
    _check_extend([0, 21, 35], [19, 7, 1], hq, hkv, 32, page_size, torch.float32, "cpu", (16, 16))


def test_extend_fp16_head_dim_64():
    _check_extend([5, 0], [12, 3], 4, 2, 64, 16, torch.float16, "cpu", (16, 16))


def test_extend_bf16_default_blocks():
    _check_extend([17], [6], 2, 1, 16, 1, torch.bfloat16, "cpu")


def test_extend_without_any_prefix():
    _check_extend([0, 0], [3, 20], 2, 2, 16, 1, torch.float32, "cpu", (16, 16))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [1, 6, 21, 40])
def test_extend_window(page_size, window):
    # prefixes longer than the window (its first tiles skipped), fresh prompts crossing it,
    # a one-token row; tiles of 16 so that a block's window starts mid-tile
    _check_extend(
        [0, 21, 35, 3], [40, 7, 1, 30], 4, 2, 32, page_size, torch.float32, "cpu", (16, 16),
        window=window,
    )  # fmt: skip


def test_extend_cap_and_sinks():
    sinks = _sinks(4)
    _check_extend([0, 21], [19, 7], 4, 1, 16, 1, torch.float32, "cpu", (16, 16), logit_cap=0.7)
    _check_extend([0, 21], [19, 7], 4, 1, 16, 1, torch.float32, "cpu", (16, 16), sinks=sinks)
    _check_extend(
        [5, 0, 40], [12, 33, 1], 4, 2, 16, 16, torch.float32, "cpu", (16, 16),
        window=10, logit_cap=2.5, sinks=sinks,
    )  # fmt: skip


def test_extend_head_dim_128_group_8_long():
    # Default 64x64 tiles: several query blocks and prefix tiles per request.
    _check_extend([130, 0, 64], [150, 65, 1], 8, 1, 128, 16, torch.float32, "cpu")


# ---------------------------------------------------------------- launcher validation


def _decode_args(**over):
    args = dict(
        q=torch.zeros(2, 4, 32),
        k_buffer=torch.zeros(10, 2, 32),
        v_buffer=torch.zeros(10, 2, 32),
        o=torch.zeros(2, 4, 32),
        kv_indptr=torch.tensor([0, 1, 2], dtype=torch.int32),
        kv_indices=torch.tensor([3, 4], dtype=torch.int32),
        num_kv_splits=torch.ones(2, dtype=torch.int32),
        max_splits=2,
        sm_scale=0.1,
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(q=torch.zeros(2, 4, 32, dtype=torch.float16)), "dtypes must match"),
        (dict(kv_indices=torch.tensor([3.0, 4.0])), "int32 or int64"),
        (dict(kv_indptr=torch.tensor([0, 1], dtype=torch.int32)), "3 entries"),
        (dict(q=torch.zeros(2, 32, 4).transpose(1, 2)), "contiguous in its last"),
        (dict(q=torch.zeros(2, 3, 32), o=torch.zeros(2, 3, 32)), "multiple of num_kv_heads"),
        (dict(k_buffer=torch.zeros(10, 2, 16)), r"\[num_slots, Hkv, 32\]"),
        (
            dict(
                q=torch.zeros(2, 4, 24),
                o=torch.zeros(2, 4, 24),
                k_buffer=torch.zeros(10, 2, 24),
                v_buffer=torch.zeros(10, 2, 24),
            ),
            "power of two",
        ),
        (dict(kv_indices=torch.zeros(2, 1, dtype=torch.int32)), "1-D"),
        (dict(o=torch.zeros(3, 4, 32)), "q's shape"),
        (dict(max_splits=0), "max_splits"),
        (dict(window=0), "window must be a positive int"),
        (dict(logit_cap=-1.0), "logit_cap must be finite"),
        (dict(sinks=torch.zeros(3)), r"sinks must be float32 \[4\]"),
        (dict(sinks=torch.zeros(4, dtype=torch.float64)), "sinks must be float32"),
    ],
)
def test_decode_validation(over, match):
    with pytest.raises(ValueError, match=match):
        decode_attention(**_decode_args(**over))


def test_extend_and_store_validation():
    q = torch.zeros(3, 2, 16)
    kv = torch.zeros(3, 1, 16)
    buf = torch.zeros(8, 1, 16)
    indptr = torch.tensor([0, 3], dtype=torch.int32)
    empty = torch.zeros(0, dtype=torch.int32)
    with pytest.raises(ValueError, match="k and v must both be"):
        extend_attention(q, kv[:2], kv, q.clone(), buf, buf, indptr, indptr[:2] * 0, empty, 3, 1.0)
    with pytest.raises(ValueError, match="kv_indptr must have 2 entries"):
        extend_attention(q, kv, kv, q.clone(), buf, buf, indptr, empty, empty, 3, 1.0)
    with pytest.raises(ValueError, match="dtypes must match"):
        extend_attention(q, kv, kv, q.clone(), buf.half(), buf, indptr, indptr, empty, 3, 1.0)
    with pytest.raises(ValueError, match="loc must have 3 entries"):
        store_kv(kv, kv, buf, buf, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="buffers must be"):
        store_kv(kv, kv, torch.zeros(8, 2, 16), buf, torch.zeros(3, dtype=torch.int64))


# ---------------------------------------------------------------- GPU, full sizes


@gpu
@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq,hkv,d", [(16, 8, 128), (32, 4, 64), (8, 8, 128)])
def test_decode_gpu(page_size, hq, hkv, d):
    lens = [1, 17, 300, 1024, 4096, 2047, 513, 64] * 4
    _check_decode(lens, hq, hkv, d, page_size, torch.bfloat16, "cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq,hkv,d", [(16, 8, 128), (32, 4, 64)])
def test_extend_gpu(page_size, hq, hkv, d):
    _check_extend(
        [0, 700, 37, 2048, 1], [513, 1, 300, 128, 1000], hq, hkv, d, page_size,
        torch.bfloat16, "cuda",
    )  # fmt: skip


@gpu
@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [512, 4096])
def test_variants_gpu(page_size, window):
    # Gemma-like heads (8 over 4, head_dim 256) with a window, a soft cap and sinks
    variant = dict(window=window, logit_cap=50.0, sinks=_sinks(8))
    lens = [1, 17, 300, 1024, 4096, 2047, 513, 5000] * 2
    _check_decode(lens, 8, 4, 256, page_size, torch.bfloat16, "cuda", **variant)
    _check_extend(
        [0, 700, 37, 2048, 1], [513, 1, 300, 128, 1000], 8, 4, 256, page_size,
        torch.bfloat16, "cuda", **variant,
    )  # fmt: skip


@gpu
@needs_cuda
def test_store_kv_gpu():
    pool = Pool(4096, 16, 8, 128, torch.bfloat16, "cuda")
    k = torch.randn(3000, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    loc = pool.alloc(3000).cuda()
    store_kv(k, v, pool.k, pool.v, loc)
    assert torch.equal(pool.k[loc], k) and torch.equal(pool.v[loc], v)
