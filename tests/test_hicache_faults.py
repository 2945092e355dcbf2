"""HiCache faults stay contained: a damaged file-tier page is a miss (and is removed), an
unwritable storage directory is refused at start-up naming the flag, a failing writer logs
once, and the host pools of every replica on the machine (--dp-size x TP ranks) must fit
in the RAM available together."""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest
import torch

from sglite.config import ServerArgs
from sglite.mem_cache import factory, file_storage
from sglite.mem_cache.file_storage import FileStorage
from sglite.mem_cache.host_pool import HostKVPool
from sglite.mem_cache.memory_pool import KVPool

SHAPE = (3, 64, 2, 8)


class _Evil:  # a pickled object that weights_only loading refuses (UnpicklingError)
    pass


def _damage(path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(bytes(range(256)) * 4)
    elif how == "foreign_pickle":
        path.write_bytes(pickle.dumps(_Evil()))
    elif how == "not_a_page":
        torch.save({"header": {"format": "other"}, "k": 1}, path)
    elif how == "a_list":
        torch.save([1, 2, 3], path)


@pytest.mark.parametrize(
    "how", ["truncated", "empty", "garbage", "foreign_pickle", "not_a_page", "a_list"]
)
def test_a_damaged_page_is_a_miss_and_is_removed(tmp_path, how):
    st = FileStorage(tmp_path, "model-a", 64)
    h0, h1 = st.hashes(np.arange(128), None, [])
    for h in (h0, h1):
        assert st.put(h, [torch.randn(SHAPE), torch.randn(SHAPE)])
    st.flush()
    st.close()
    restarted = FileStorage(tmp_path, "model-a", 64)
    _damage(restarted.path(h0), how)
    assert restarted.lookup([h0, h1], 0) == 2  # it exists on disk: only reading tells
    assert restarted.get(h0, [(torch.float32, SHAPE)] * 2) is None  # a miss, not an exception
    assert restarted.num_bad_pages == 1
    assert not restarted.path(h0).exists()  # removed: the next restart does not trip on it
    assert restarted.lookup([h0, h1], 0) == 0
    assert restarted.get(h1, [(torch.float32, SHAPE)] * 2) is not None  # the good page still reads
    restarted.close()


def test_an_unwritable_storage_directory_is_refused_naming_the_flag(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=r"--hicache-storage-dir .*a_file/sub.*cannot write"):
        FileStorage(blocker / "sub", "model-a", 64)
    with pytest.raises(ValueError, match="--hicache-storage-dir"):
        FileStorage(blocker, "model-a", 64)  # exists, but is a file


def test_a_failing_writer_logs_once_and_counts(tmp_path, monkeypatch, caplog):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    st = FileStorage(tmp_path, "model-a", 64)
    monkeypatch.setattr(file_storage.torch, "save", full_disk)
    hashes = st.hashes(np.arange(64 * 6), None, [])
    with caplog.at_level(logging.WARNING, logger="sglite.mem_cache.file_storage"):
        for h in hashes:
            st.put(h, [torch.zeros(SHAPE), torch.zeros(SHAPE)])
        st.flush()
    st.close()
    assert st.num_failed_pages == 6 and st.num_written_pages == 0
    lines = [r for r in caplog.records if "writing a page" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None  # one line, no traceback
    assert "No space left" in lines[0].getMessage()
    assert not any(st.contains(h) for h in hashes)  # failed pages are misses, not "known"


def _pool(num_slots=4096):
    return KVPool(num_slots, 4, 3, 2, 8, torch.float32, "cpu")


def test_host_pools_of_all_dp_replicas_must_fit_together(monkeypatch):
    dev = _pool()
    args = ServerArgs(enable_hierarchical_cache=True, hicache_ratio=2.0)
    slots = factory.host_pool_slots(args, dev)
    need = HostKVPool.bytes_for(dev, slots)
    monkeypatch.setattr(factory, "mem_available_bytes", lambda: 3 * need)
    factory.check_host_pool_fits(args, dev, slots)  # one replica: fits
    factory.check_host_pool_fits(args.replace(dp_size=3), dev, slots)  # three: just fit
    with pytest.raises(ValueError, match=r"4 replicas \(--dp-size 4\).*MemAvailable"):
        factory.check_host_pool_fits(args.replace(dp_size=4), dev, slots)
