"""The CPU KV pool's default size (sglite.mem_cache.kv_sizing) and its untouched memory."""

from __future__ import annotations

import pytest
import torch

from sglite.mem_cache.kv_sizing import (
    CPU_KV_BUDGET_BYTES,
    CPU_KV_MIN_TOKENS,
    default_cpu_kv_size,
    kv_slots_for_budget,
)
from sglite.mem_cache.memory_pool import KVPool, untouched_zeros

GIB = 1 << 30
SMOLLM2_FP32 = 46_080  # bytes per token: 30 layers x K and V x 3 heads x 64 dims x 4 B


def test_small_context_gets_the_floor():
    size = default_cpu_kv_size(2048, SMOLLM2_FP32, 1, 64 * GIB)
    assert size.num_slots == CPU_KV_MIN_TOKENS
    assert "2048-token context" in size.reason and "--max-total-tokens" in size.reason


def test_demo_model_holds_two_contexts_not_a_share_of_ram():
    size = default_cpu_kv_size(8192, SMOLLM2_FP32, 1, 64 * GIB)
    assert size.num_slots == 16384  # 0.70 GiB where the RAM rule gave 46,602 tokens (2 GiB)
    assert size.num_slots * SMOLLM2_FP32 < CPU_KV_BUDGET_BYTES // 2


def test_long_context_is_capped_by_the_budget_and_ram():
    per_token = 128 * 1024  # a 7B in fp16: 32 layers x 2 x 8 heads x 128 x 2 B
    big = default_cpu_kv_size(32768, per_token, 16, 64 * GIB)
    assert big.num_slots == kv_slots_for_budget(CPU_KV_BUDGET_BYTES, per_token, 16)
    assert big.num_slots % 16 == 0 and "capped" in big.reason
    assert big.num_slots < 32768 and "less than one full-context request" in big.reason
    small_ram = default_cpu_kv_size(8192, per_token, 16, 4 * GIB)  # RAM/4 = 1 GiB
    assert small_ram.num_slots == kv_slots_for_budget(GIB, per_token, 16)
    assert (small_ram.num_slots + 16) * per_token <= GIB


def test_one_full_context_request_fits_when_the_budget_allows():
    per_token = 64 * 1024  # 2 GiB holds 32,767 tokens: one 20k request but not two
    size = default_cpu_kv_size(20000, per_token, 1, 64 * GIB)
    assert 20000 <= size.num_slots < 40000
    assert "less than one full-context" not in size.reason


@pytest.mark.parametrize("page_size", [1, 16])
def test_sizes_are_whole_pages(page_size):
    size = default_cpu_kv_size(8200, SMOLLM2_FP32, page_size, 64 * GIB)
    assert size.num_slots % page_size == 0 and size.num_slots >= 16400


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_cpu_pool_memory_is_zero_and_committed_only_when_written():
    before = _rss_kb()
    pool = KVPool(65536, 1, 4, 8, 64, torch.float32, "cpu")  # 2 x 4 x 16 MiB = 128 MiB
    assert _rss_kb() - before < 16 << 10  # far below the pool's 131,072 KiB
    assert pool.memory_bytes() == 2 * 4 * 65537 * 8 * 64 * 4
    k = torch.ones(3, 8, 64)
    pool.set_kv(0, torch.tensor([1, 5, 9]), k, 2 * k)
    assert torch.equal(pool.k_buffer[0][5], k[0]) and torch.equal(pool.v_buffer[0][9], 2 * k[0])
    assert not pool.k_buffer[0][[0, 2, 65536]].any() and not pool.k_buffer[3].any()


def test_untouched_zeros_other_dtypes_and_small_buffers():
    big = untouched_zeros((1 << 20, 2), torch.bfloat16, torch.device("cpu"))
    assert big.dtype == torch.bfloat16 and big.shape == (1 << 20, 2) and not big.any()
    big[7] = 1.5
    assert big.float().sum().item() == 3.0
    small = untouched_zeros((4, 4), torch.int32, torch.device("cpu"))
    assert small.dtype == torch.int32 and not small.any()
