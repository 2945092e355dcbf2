"""Scheduler fuzz with the HiCache host tier: test_scheduler_fuzz's random workloads,
configurations and aborts, with every scheduler's cache given a host tier (a random write
policy and host size) over the ChainWorker's K/V. The ChainWorker's outputs are a pure
function of the tokens exactly when every slot holds the right K/V, so a wrong backup, a
load-back into the wrong slots or a host slot reused too early changes some output; the
tree must publish the right K/V, and the idle invariants (device and host) must hold. KV
events are recorded too: every event must be consistent with those before it (a block
loaded back is stored again under its new slots) and the blocks left are the device tree's."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import test_scheduler_fuzz as fuzz
from fixtures.chain_worker import ChainWorker
from fixtures.kv_subscriber import apply_events
from sglite.kv_events.recorder import KvEventRecorder
from sglite.mem_cache.hicache import HiCache
from sglite.mem_cache.host_pool import HostKVPool
from sglite.mem_cache.memory_pool import KVPool

NUM_CASES = 60
POLICIES = ["write_through", "write_through_selective", "write_back"]
LOADED: list[int] = []  # load-back tokens per case, for the coverage check


def attach_host_tier(cache, kv: np.ndarray, rng: random.Random, core) -> None:
    """Give `cache` (empty) a host tier whose copies move the ChainWorker's K/V."""
    if not cache.enabled:
        return
    ps = cache.page_size
    values = torch.from_numpy(kv.view(np.int64)).view(-1, 1, 1)  # shares the worker's memory
    pool = KVPool(len(kv) - ps, ps, 1, 1, 1, torch.int64, "cpu")
    pool.k_buffer = pool.v_buffer = [values]  # its one buffer (twice) is the worker's K/V
    host_slots = max(int(pool.num_slots * rng.choice([0.5, 1.5, 4.0])) // ps, 1) * ps
    args = cache.tree  # the device-only tree the Harness built: same page size and policy
    assert args.node_count() == 0
    cache.tree = core.RadixTree(ps, rng.choice(["lru", "lfu", "fifo", "priority"]), host_slots)
    cache.tier = HiCache(cache, HostKVPool(pool, host_slots), rng.choice(POLICIES))


@pytest.mark.parametrize("seed", range(NUM_CASES))
def test_scheduler_fuzz_with_host_tier(core, seed, monkeypatch):
    rng = random.Random(10_000 + seed)
    harnesses = []
    real_init = fuzz.Harness.__init__

    def init(self, *args, **kwargs):
        from test_kv_events import Recording

        real_init(self, *args, **kwargs)
        self.sched.cache.events = KvEventRecorder(self.args.page_size)
        self.sched.kv_publisher = Recording()
        harnesses.append(self)

    class HostTierWorker(ChainWorker):
        def __init__(self, table, num_slots, vocab=48, context=4096):
            super().__init__(table, num_slots, vocab, context)
            attach_host_tier(harnesses[-1].sched.cache, self.kv, rng, core)

    monkeypatch.setattr(fuzz.Harness, "__init__", init)
    monkeypatch.setattr(fuzz, "ChainWorker", HostTierWorker)
    result = fuzz.run_case(core, seed)
    sched = harnesses[0].sched
    cache = sched.cache
    held = apply_events(sched.kv_publisher.batches)
    assert len(held) * cache.page_size == cache.tree.total_size()
    if cache.enabled:
        cache.tier.check_idle()
        cache.tree.sanity_check()
    assert result["steps"] > 0
    LOADED.append(cache.tier.num_load_back_tokens if cache.enabled else 0)


def test_fuzz_cases_loaded_back(core):
    """The cases above exercised load-back (run after them, same session)."""
    if len(LOADED) < NUM_CASES // 2:
        pytest.skip("run with the fuzz cases")
    assert sum(x > 0 for x in LOADED) >= len(LOADED) // 4, LOADED
