"""HiCache's host KV pool and file tier without a model: real copies, byte counts, the page
hash chain, files that survive a new FileStorage and refuse a mismatched server, the RAM check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglite.config import ServerArgs
from sglite.mem_cache import factory
from sglite.mem_cache.file_storage import FileStorage, chain_hashes, storage_page_len
from sglite.mem_cache.host_pool import HostKVPool
from sglite.mem_cache.memory_pool import KVPool


def _pool(num_slots=64, page_size=4, layers=3, device="cpu"):
    pool = KVPool(num_slots, page_size, layers, 2, 8, torch.float32, device)
    g = torch.Generator().manual_seed(0)
    for b in pool.k_buffer + pool.v_buffer:
        b.copy_(torch.randn(b.shape, generator=g))
    return pool


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])],
)  # fmt: skip
def test_backup_and_load_copy_exact_bytes_into_separate_buffers(device):
    dev = _pool(device=device)
    host = HostKVPool(dev, 128)
    assert host.k_buffer[0].device.type == "cpu"
    assert host.k_buffer[0].is_pinned() == (device == "cuda")
    assert host.k_buffer[0].data_ptr() != dev.k_buffer[0].data_ptr()
    src = np.arange(4, 12)
    dst = np.arange(100, 108)
    host.backup(src, dst)
    for layer in range(dev.num_layers):
        assert torch.equal(host.k_buffer[layer][100:108], dev.k_buffer[layer][4:12].cpu())
        assert torch.equal(host.v_buffer[layer][100:108], dev.v_buffer[layer][4:12].cpu())
    expected = {layer: dev.k_buffer[layer][4:12].clone() for layer in range(dev.num_layers)}
    for b in dev.k_buffer + dev.v_buffer:  # the device copy is gone (evicted, reused)
        b[4:12] = 0
    host.load(dst, np.arange(40, 48))
    for layer in range(dev.num_layers):
        assert torch.equal(dev.k_buffer[layer][40:48], expected[layer])
    per_slot = KVPool.bytes_per_slot(3, 2, 8, torch.float32)
    assert host.num_bytes_to_host == host.num_bytes_to_device == 8 * per_slot
    with pytest.raises(ValueError):
        host.backup(src, dst[:3])


def test_host_pool_rejects_partial_pages():
    with pytest.raises(ValueError, match="multiple of page_size"):
        HostKVPool(_pool(), 10)


def test_hash_chain_depends_on_prefix_namespace_and_seed():
    toks = np.arange(256)
    a = chain_hashes(toks, 64, "s", None, [])
    assert len(a) == 4 and len(set(a)) == 4
    assert chain_hashes(toks, 64, "s", None, a[:2]) == a  # incremental
    assert chain_hashes(toks, 64, "s", "lora", [])[0] != a[0]
    assert chain_hashes(toks, 64, "t", None, [])[0] != a[0]
    other = toks.copy()
    other[0] = 999
    b = chain_hashes(other, 64, "s", None, [])
    assert all(x != y for x, y in zip(a, b))  # a changed first page changes every later key
    assert storage_page_len(1) == 64 and storage_page_len(16) == 64 and storage_page_len(128) == 128


def test_file_tier_pages_survive_a_new_storage_and_refuse_mismatches(tmp_path):
    page = [torch.randn(64, 2, 8) for _ in range(6)]  # one per buffer: 3 layers' K, then V
    specs = [(torch.float32, (64, 2, 8))] * 6
    st = FileStorage(tmp_path, "model-a", 64)
    (h,) = st.hashes(np.arange(64), None, [])
    assert st.put(h, page)
    st.flush()
    assert st.num_written_pages == 1
    again = FileStorage(tmp_path, "model-a", 64)  # a restarted server
    assert again.lookup([h, "0" * 64], 0) == 1
    got = again.get(h, specs)
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got, page))
    assert again.get(h, [(torch.float16, (64, 2, 8))] * 6) is None  # another dtype never reads it
    assert again.get(h, [(torch.float32, (64, 1, 576))] * 3) is None  # nor another layout
    other = FileStorage(tmp_path, "model-b", 64)
    assert other.hashes(np.arange(64), None, [])[0] != h  # another model: other keys
    assert other.get(h, specs) is None  # and the header refuses it
    for s in (st, again, other):
        s.close()


def test_host_pool_larger_than_free_ram_is_refused(monkeypatch):
    monkeypatch.setattr(factory, "mem_available_bytes", lambda: 1 << 20)
    args = ServerArgs(enable_hierarchical_cache=True, hicache_ratio=4.0)
    dev = _pool(num_slots=4096)
    slots = factory.host_pool_slots(args, dev)
    assert slots == 4 * 4096
    with pytest.raises(ValueError, match=r"GiB \(16384 tokens\).*MemAvailable.*hicache-ratio"):
        factory.check_host_pool_fits(args, dev, slots)
    sized = ServerArgs(enable_hierarchical_cache=True, hicache_size=0.001)
    per_slot = KVPool.bytes_per_slot(3, 2, 8, torch.float32)
    assert factory.host_pool_slots(sized, dev) == (10**6 // per_slot - 4) // 4 * 4


def test_host_pools_of_all_tp_ranks_on_a_node_must_fit_together(monkeypatch):
    dev = _pool(num_slots=4096)
    args = ServerArgs(enable_hierarchical_cache=True, hicache_ratio=2.0)
    need = HostKVPool.bytes_for(dev, factory.host_pool_slots(args, dev))
    monkeypatch.setattr(factory, "mem_available_bytes", lambda: 2 * need)
    factory.check_host_pool_fits(args, dev, 2 * 4096)  # one rank: fits
    tp3 = args.replace(tp_size=3)
    with pytest.raises(ValueError, match="on each of 3 TP ranks.*MemAvailable"):
        factory.check_host_pool_fits(tp3, dev, 2 * 4096)


def test_hicache_flags_validate():
    with pytest.raises(ValueError, match="radix cache"):
        ServerArgs(enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(ValueError, match="hicache-ratio"):
        ServerArgs(enable_hierarchical_cache=True, hicache_ratio=0.5)
    with pytest.raises(ValueError, match="add --enable-hierarchical-cache"):
        ServerArgs(hicache_storage_backend="file")
    with pytest.raises(ValueError, match="hicache-write-policy"):
        ServerArgs(hicache_write_policy="sometimes")


def test_hicache_cli_flags_and_alias():
    from sglite.cli import build_parser, parse_server_args

    args = parse_server_args(
        ["--enable-hicache", "--hicache-ratio", "3", "--hicache-write-policy", "write_back"]
    )
    assert args.enable_hierarchical_cache and args.hicache_ratio == 3.0
    assert args.hicache_write_policy == "write_back"
    args = parse_server_args(["--enable-hierarchical-cache", "--hicache-storage-backend", "file"])
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "file"
    text = build_parser().format_help()
    for flag in ("--enable-hierarchical-cache", "--hicache-ratio", "--hicache-size",
                 "--hicache-write-policy", "--hicache-storage-backend", "--hicache-storage-dir"):  # fmt: skip
        assert flag in text


def test_hicache_metrics_under_sglang_names():
    from sglite.server.metrics import ServerMetrics

    m = ServerMetrics("m")
    stats = {"hicache_host_used_tokens": 96, "hicache_host_total_tokens": 512,
             "num_evicted_tokens": 40, "num_load_back_tokens": 24}  # fmt: skip
    m.update_from_stats(stats)
    m.update_from_stats({**stats, "num_evicted_tokens": 50})  # running totals: +10
    text = m.render().decode()
    assert 'sglang:hicache_host_used_tokens{model_name="m"} 96.0' in text
    assert 'sglang:hicache_host_total_tokens{model_name="m"} 512.0' in text
    assert 'sglang:evicted_tokens_total{model_name="m"} 50.0' in text
    assert 'sglang:load_back_tokens_total{model_name="m"} 24.0' in text
