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

import test_scheduler_fuzz as fuzz
from fixtures.chain_worker import ChainWorker, attach_host_tier, make_lazy, reference_tokens
from fixtures.kv_subscriber import apply_events
from fixtures.sched import Harness
from sglite.kv_events.recorder import KvEventRecorder
from sglite.scheduler.worker import WorkerClient

NUM_CASES = 60
POLICIES = ["write_through", "write_through_selective", "write_back"]
LOADED: list[int] = []  # load-back tokens per case, for the coverage check


def draw_host_tier(cache, kv: np.ndarray, rng: random.Random, core) -> None:
    """A random host tier (write policy, host size, eviction policy) for `cache`."""
    if not cache.enabled:
        return
    ps = cache.page_size
    host_slots = max(int((len(kv) - ps) * rng.choice([0.5, 1.5, 4.0])) // ps, 1) * ps
    eviction = rng.choice(["lru", "lfu", "fifo", "priority"])
    attach_host_tier(cache, kv, core, host_slots, rng.choice(POLICIES), eviction)


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
            draw_host_tier(harnesses[-1].sched.cache, self.kv, rng, core)

    monkeypatch.setattr(fuzz.Harness, "__init__", init)
    monkeypatch.setattr(fuzz, "ChainWorker", HostTierWorker)
    # more of the state of item 11 (network issue): twins computing the same prefix in one
    # batch, the overlap loop, the mirrored table; the revisits then load back at once
    monkeypatch.setattr(fuzz, "TWIN_SHARE", 0.3)
    monkeypatch.setattr(fuzz, "OVERLAP_SHARE", 0.8)
    monkeypatch.setattr(fuzz, "MIRRORED_SHARE", 0.5)
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


@pytest.mark.parametrize("mirrored", [True, False])
def test_load_back_never_overwrites_slots_a_launched_batch_reads(core, mirrored):
    """Item 11 of the network issue, made deterministic with a lazy worker (overlap loop).
    A and B compute the same 20 uncached tokens in one prefill batch (under the in-batch
    prefix gate's threshold); processing that batch publishes A's copy and frees B's while
    B's first decode row, already launched, still reads B's (the mirrored table travelled
    with it). C's host hit is then loaded back at once into the freed slots, before that
    decode row ran: B's token came out wrong. Frees of slots a launched batch may read now
    wait until that batch's result is processed."""
    cap, vocab = 64, 48
    h = Harness(core, total_tokens=cap, disable_overlap_schedule=False, rows=8)
    sched = h.sched
    worker = ChainWorker(sched.cache.table, cap + 1, vocab)
    attach_host_tier(sched.cache, worker.kv, core, 128, "write_through", "lru")
    if mirrored:
        sched.cache.table = np.zeros_like(sched.cache.table)
        sched.cache.mirrored = True
        worker.table = None
    sched.client = WorkerClient(worker, overlap=False)
    make_lazy(sched.client)
    system = list(range(3, 27))  # 24 tokens: C's host hit
    shared = [30 + i for i in range(20)]
    h.add("x", system + [40], max_new_tokens=1, ignore_eos=True)
    sched.run_until_idle()
    sched.cache.evict_for(cap)  # X's prompt now lives in the host tier only
    assert sched.cache.tree.evictable_size() == 0
    h.add("a", shared + [41], max_new_tokens=3, ignore_eos=True)
    h.add("b", shared + [42], max_new_tokens=3, ignore_eos=True)
    sched.step()  # the prefill of A and B, launched
    sched.step()  # their first decode launched, then the prefill's result processed
    h.add("c", system + [43, 44], max_new_tokens=2, ignore_eos=True)
    sched.step()  # C's admission: its host hit was loaded back at once, into B's copies
    h.run()
    assert sched.cache.tier.num_load_back_tokens >= 16, "the test must load back"
    res = h.results()
    for rid, prompt in (("a", shared + [41]), ("b", shared + [42]), ("c", system + [43, 44])):
        n = len(res[rid]["ids"])
        assert res[rid]["ids"] == reference_tokens(worker, prompt, n), rid
