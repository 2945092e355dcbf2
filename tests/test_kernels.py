"""sglite_kernels against plain torch references.

On CPU the kernels run through the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET),
so these cases are small: a few requests, short ragged sequences, slots allocated page-wise
from a shuffled page list (page sizes 1 and 16), GQA, and small tiles so that several tiles
and splits are crossed. The ``gpu`` cases repeat them at full sizes with bf16 tolerances.
The cases live in tests/fixtures/kernel_cases.py; windows, soft-caps and sinks are tested in
test_kernel_variants.py.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("sglite_kernels") is None:  # source checkout, not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from fixtures.kernel_cases import Pool, check_decode, check_extend  # noqa: E402
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


@pytest.fixture(autouse=True)
def _cpu_cases_need_the_interpreter(request):
    if request.node.get_closest_marker("gpu") is None and not interpreted():
        pytest.skip("CPU kernel cases need Triton's interpreter, off under SGL_TEST_GPU=1")


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


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (8, 2)])
def test_decode_fp32(page_size, hq, hkv):
    # Split counts 1..3 over tiles of 16: ragged last tiles, and an empty trailing split.
    check_decode([1, 37, 20], hq, hkv, 32, page_size, torch.float32, "cpu", [1, 3, 3], 16)


def test_decode_bf16_head_dim_64_wide_group():
    check_decode([9, 30], 8, 1, 64, 16, torch.bfloat16, "cpu", [2, 2], 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_head_dim_128_group_8_default_tiles(dtype):
    # Default tile and the split heuristic (one split at these lengths), 9 ragged requests.
    lens = [1, 2, 3, 63, 64, 65, 100, 129, 250]
    check_decode(lens, 16, 2, 128, 16, dtype, "cpu")


def test_decode_many_splits_and_heuristic():
    # Lengths past MIN_SPLIT_LEN so the heuristic picks several splits.
    check_decode([700, 257, 5], 4, 2, 16, 16, torch.float32, "cpu", None, 64)


def test_decode_clamps_bad_split_counts():
    # 0 and counts above max_splits are clamped on the device instead of dropping tokens.
    check_decode([12, 40], 2, 1, 16, 1, torch.float32, "cpu", [0, 9], 16)


def test_num_kv_splits_heuristic():
    lens = torch.tensor([1, 255, 256, 257, 4096, 100_000])
    got = num_kv_splits(lens, num_kv_heads=8, num_sms=132, max_splits=16)
    # 6 x 8 = 48 programs per split level; about 4 programs per SM wants 11 splits.
    assert got.dtype == torch.int32
    assert got.tolist() == [1, 1, 1, 2, 11, 11]
    big_batch = num_kv_splits(torch.full((64,), 4096), 8, 132, 16)
    assert big_batch.tolist() == [2] * 64


# ---------------------------------------------------------------- extend


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1)])
def test_extend_fp32(page_size, hq, hkv):
    # No prefix, a prefix with a ragged page, a 1-token extend (a decode row of a mixed batch).
    check_extend([0, 21, 35], [19, 7, 1], hq, hkv, 32, page_size, torch.float32, "cpu", (16, 16))


def test_extend_fp16_head_dim_64():
    check_extend([5, 0], [12, 3], 4, 2, 64, 16, torch.float16, "cpu", (16, 16))


def test_extend_bf16_default_blocks():
    check_extend([17], [6], 2, 1, 16, 1, torch.bfloat16, "cpu")


def test_extend_without_any_prefix():
    check_extend([0, 0], [3, 20], 2, 2, 16, 1, torch.float32, "cpu", (16, 16))


def test_extend_head_dim_128_group_8_long():
    # Default 64x64 tiles: several query blocks and prefix tiles per request.
    check_extend([130, 0, 64], [150, 65, 1], 8, 1, 128, 16, torch.float32, "cpu")


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
    check_decode(lens, hq, hkv, d, page_size, torch.bfloat16, "cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq,hkv,d", [(16, 8, 128), (32, 4, 64)])
def test_extend_gpu(page_size, hq, hkv, d):
    check_extend(
        [0, 700, 37, 2048, 1], [513, 1, 300, 128, 1000], hq, hkv, d, page_size,
        torch.bfloat16, "cuda",
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
