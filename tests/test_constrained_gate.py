"""The scheduler's grammar gate and overlap rule, without a model (NullWorker, fake grammars):
constrained requests wait for their grammar and no one else does, time out, can be aborted
while they wait, and in the overlap loop each mask is built only after the row's previous
token was accepted; batches without constrained rows carry no mask at all."""

from __future__ import annotations

import pytest

from fixtures.grammars import BlockingBackend, FakeClock, settle
from fixtures.sched import Harness
from sglite.constrained.grammar_queue import GrammarQueue
from sglite.scheduler.worker import NullWorker


class MaskingWorker(NullWorker):
    """Records, for every batch, which grammars it masked and how many tokens each had accepted."""

    def __init__(self):
        super().__init__(1000)
        self.masks: list = []  # per batch: None, or [(grammar, num_accepted)]

    def run(self, fi):
        rows = fi.vocab_mask
        self.masks.append(None if rows is None else [(g, g.num_accepted) for g in rows.grammars])
        return super().run(fi)


def harness(core, backend, *, overlap: bool, clock=None, **kw) -> tuple[Harness, MaskingWorker]:
    worker = MaskingWorker()
    h = Harness(core, worker=worker, disable_overlap_schedule=not overlap, **kw)
    h.sched.grammars = GrammarQueue(backend, 10.0, clock=clock or FakeClock())
    return h, worker


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_masks_see_every_previous_token(core, overlap):
    """With a lagging matcher (the overlap loop building a batch before processing the last
    one) two masks of a request would see the same count; here they see 0, 1, 2, ..."""
    h, worker = harness(core, BlockingBackend(blocked=False), overlap=overlap)
    for i in range(4):
        h.add(f"c{i}", [1, 2, 3, 4 + i], max_new_tokens=12 + i, regex="x")
        h.add(f"u{i}", [9, 8, 7 + i], max_new_tokens=20)
    h.run()
    counts: dict[int, list[int]] = {}
    for mask in worker.masks:
        for grammar, accepted in mask or ():
            counts.setdefault(id(grammar), []).append(accepted)
    assert sorted(len(c) for c in counts.values()) == [12, 13, 14, 15]
    assert all(c == list(range(len(c))) for c in counts.values()), counts
    results = h.results()
    assert all(len(results[f"u{i}"]["ids"]) == 20 for i in range(4))


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_unconstrained_batches_carry_no_mask(core, overlap):
    h, worker = harness(core, BlockingBackend(blocked=False), overlap=overlap)
    for i in range(6):
        h.add(f"u{i}", [5, 6, 7 + i], max_new_tokens=8)
    h.run()
    assert worker.masks and all(m is None for m in worker.masks)
    assert h.sched.grammars.num_compiles == 0


def test_unconstrained_requests_do_not_wait_for_grammars(core):
    backend, clock = BlockingBackend(), FakeClock()
    h, _ = harness(core, backend, overlap=True, clock=clock)
    h.add("slow", [1, 2, 3], regex="x")
    h.add("free", [4, 5, 6], max_new_tokens=5)
    for _ in range(20):
        h.sched.step()
    results = h.results()
    assert len(results["free"]["ids"]) == 5 and results["free"]["finish"]["type"] == "length"
    assert "slow" not in results and len(h.sched.grammars) == 1
    assert h.sched.stats()["num_waiting_reqs"] == 1
    backend.release.set()
    settle(h.sched.grammars)
    h.run()
    assert len(h.results()["slow"]["ids"]) == 8


def test_a_slow_grammar_times_out_with_503(core):
    backend, clock = BlockingBackend(), FakeClock()
    h, _ = harness(core, backend, overlap=False, clock=clock)
    h.add("slow", [1, 2, 3], regex="x")
    h.sched.step()
    assert h.sched.has_work() and not h.results()
    clock.now += 10.5
    h.sched.step()
    finish = h.results()["slow"]["finish"]
    assert finish["type"] == "abort" and finish["status_code"] == 503
    assert "did not compile within 10 s" in finish["message"]
    assert not h.sched.has_work() and h.sched.counters["num_rejected_reqs"] == 1
    backend.release.set()
    settle(h.sched.grammars)


def test_abort_while_waiting_for_the_grammar(core):
    backend = BlockingBackend()
    h, _ = harness(core, backend, overlap=True)
    h.add("wait-a", [1, 2, 3], regex="x")
    h.add("wait-b", [1, 2, 3], regex="y")
    h.sched.step()
    h.sched.abort("wait-a", exact=True, message="client went away")
    results = h.results()
    assert results["wait-a"]["finish"] == {
        "type": "abort",
        "message": "client went away",
        "status_code": 499,
    }
    assert len(h.sched.grammars) == 1 and h.sched.counters["num_aborted_reqs"] == 1
    backend.release.set()
    settle(h.sched.grammars)
    h.run()
    assert len(h.results()["wait-b"]["ids"]) == 8 and h.results()["wait-a"]["n_finish"] == 1
