"""Fair admission (scheduler/admission.py) without a model: a small request passes a large one
the budget refuses for memory, the lookahead is bounded, and the refused request cannot
starve under a hostile stream of small ones (it is admitted within a bounded number of
steps, while without the aging rule the same stream starves it)."""

from __future__ import annotations

import random

import pytest

from fixtures.sched import Harness
from sglite.config import ServerArgs
from sglite.scheduler import admission

LOOPS = {"normal": True, "overlap": False}  # value: disable_overlap_schedule


def waiting_ids(h: Harness) -> list[str]:
    return [r.rid for r in h.sched.waiting]


@pytest.mark.parametrize("loop", LOOPS)
def test_a_small_request_passes_a_large_one_refused_for_memory(core, loop):
    """Item 9 of the network issue, scaled down: requests that ignore EOS reserve their whole
    max_new_tokens; three fill the pool, the fourth waits. An 8-token request that fits in
    what is left used to wait behind it until one of the three finished."""
    h = Harness(core, total_tokens=1000, disable_overlap_schedule=LOOPS[loop])
    for i in range(4):
        h.add(f"big{i}", [5] * 10, max_new_tokens=300, ignore_eos=True)
    for _ in range(3):
        h.sched.step()
    assert waiting_ids(h) == ["big3"]
    h.add("small", [7] * 6, max_new_tokens=8)
    steps = 0
    while "small" not in {rid for rid, r in h.results().items() if r["finish"]}:
        h.sched.step()
        steps += 1
        assert steps < 40, "the small request is held behind the large one"
    assert waiting_ids(h) == ["big3"]  # the large one still waits: it does not fit yet
    assert h.sched.counters["num_bypassing_reqs"] == 1
    h.run()
    assert h.admission_order() == ["big0", "big1", "big2", "small", "big3"]
    assert h.results()["big3"]["finish"] == {"type": "length", "length": 300}


def test_without_lookahead_the_pass_stops_at_the_refused_one(core):
    """--prefill-lookahead-requests 0 is SGLang's rule: the small request waits its turn."""
    h = Harness(core, total_tokens=1000, prefill_lookahead_requests=0)
    for i in range(4):
        h.add(f"big{i}", [5] * 10, max_new_tokens=300, ignore_eos=True)
    h.add("small", [7] * 6, max_new_tokens=8)
    h.run()
    assert h.admission_order() == ["big0", "big1", "big2", "big3", "small"]
    assert h.sched.counters["num_bypassing_reqs"] == 0


@pytest.mark.parametrize("lookahead", [1, 2])
def test_the_lookahead_is_bounded(core, lookahead):
    """Two large requests are refused; the small one is the second candidate past the head."""
    h = Harness(core, total_tokens=1000, prefill_lookahead_requests=lookahead)
    for i in range(5):
        h.add(f"big{i}", [5] * 10, max_new_tokens=300, ignore_eos=True)
    h.add("small", [7] * 6, max_new_tokens=8)
    h.sched.step()
    admitted = {r.rid for r in h.sched.running}
    assert admitted >= {"big0", "big1", "big2"} and not admitted & {"big3", "big4"}
    assert ("small" in admitted) == (lookahead >= 2)


def run_stream(core, loop: str, rng: random.Random, head_max_new: int, max_steps: int):
    """Small requests arrive at a steady rate the server keeps up with; a large request H
    arrives once they run. Returns (step H was admitted or None, bypassing admissions)."""
    small_new = rng.choice([12, 20, 30])
    h = Harness(
        core,
        total_tokens=1000,
        disable_overlap_schedule=LOOPS[loop],
        enable_mixed_chunk=True,  # the running requests decode while new ones prefill
        chunked_prefill_size=64,
    )
    for step in range(max_steps):
        h.add(f"s{step}", [rng.randrange(3, 50) for _ in range(5)], max_new_tokens=small_new)
        if step == 60:
            h.add("H", [5] * 10, max_new_tokens=head_max_new, ignore_eos=True)
        h.sched.step()
        if step >= 60 and "H" not in waiting_ids(h):
            return step - 60, h.sched.counters["num_bypassing_reqs"]
    return None, h.sched.counters["num_bypassing_reqs"]


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("seed", range(3))
def test_the_refused_request_cannot_starve_under_a_stream_of_small_ones(core, loop, seed):
    """H does not fit while the small ones run; they pass it only while it would not fit
    even without them, so once it would, they drain and it is admitted: within the lifetime
    of the requests that passed it (a few dozen steps here), however long the stream."""
    rng = random.Random(seed)
    waited, bypassed = run_stream(core, loop, rng, rng.choice([850, 900, 950]), 1500)
    assert waited is not None, "the large request starved"
    assert waited < 150
    assert bypassed > 0  # small ones did pass it while it could not fit


def test_without_the_aging_rule_the_same_stream_starves_it(core, monkeypatch):
    """The scenario above is hostile enough: with only the lookahead bound (no aging), the
    small requests keep taking the memory H needs, and H is never admitted."""

    def lookahead_only(self) -> bool:
        if self.head is None:
            return True
        self.num_tried += 1
        return self.num_tried <= self.max_lookahead

    monkeypatch.setattr(admission.HeadOfLineGuard, "may_try", lookahead_only)
    waited, bypassed = run_stream(core, "normal", random.Random(0), 900, 1000)
    assert waited is None and bypassed > 500


def test_lookahead_flag_validates():
    assert ServerArgs().prefill_lookahead_requests == 32
    with pytest.raises(ValueError, match="--prefill-lookahead-requests: must be >= 0"):
        ServerArgs(prefill_lookahead_requests=-1)


# ---------------------------------------------------------------- the drained budget (issue 36)
def drain(core, loop: str, short_after: int | None, until_retraction: bool):
    """Issue 36's scene: a 12,600-token pool, 4 requests of 5,000 ignore_eos tokens (3 run,
    1 waits); each running one reserves 4,096 tokens while its KV grows a token a step, so the
    budget's room turns negative after ~100 decode steps. An 8-token request arrives after
    `short_after` decode steps. Returns (decode steps from its arrival to its admission,
    decode steps at the first retraction or None, waiting ids then)."""
    h = Harness(
        core, total_tokens=12_600, context_length=8192, disable_overlap_schedule=LOOPS[loop]
    )
    for i in range(4):
        h.add(f"long{i}", [5] * 8, max_new_tokens=5000, ignore_eos=True)
    counters = h.sched.counters
    added = admitted_after = None
    for _ in range(6000):
        decoded = counters["num_decode_batches"]
        if short_after is not None and added is None and decoded >= short_after:
            h.add("short", [7] * 8, max_new_tokens=8)
            added = decoded
        h.sched.step()
        if counters["num_retracted_reqs"]:
            return admitted_after, counters["num_decode_batches"], waiting_ids(h)
        if added is not None and admitted_after is None and "short" not in waiting_ids(h):
            admitted_after = counters["num_decode_batches"] - added
            if not until_retraction:
                return admitted_after, None, waiting_ids(h)
    raise AssertionError("no retraction in 6000 steps")


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("short_after", [20, 100])
def test_a_short_request_is_admitted_when_the_budget_is_drained(core, loop, short_after):
    """After 100 steps the budget refuses every candidate by its estimate; the short request's
    whole life (8 + 8 tokens, and 10 more for each running request) fits in what is free, so
    it is admitted at once, as it is after 20 steps by the estimate itself."""
    admitted_after, _, waiting = drain(core, loop, short_after, until_retraction=False)
    assert admitted_after is not None and admitted_after <= 2
    assert waiting == ["long3"]


@pytest.mark.parametrize("loop", LOOPS)
def test_the_short_request_brings_no_retraction_forward(core, loop):
    """The reservation's intent holds: the first retraction comes after the same number of
    decode steps with the short request as without it (it finished long before)."""
    _, alone, _ = drain(core, loop, None, until_retraction=True)
    admitted_after, with_short, _ = drain(core, loop, 100, until_retraction=True)
    assert admitted_after is not None and admitted_after <= 2
    assert with_short == alone
    assert 4100 < alone < 4200  # 3 x (8 + steps) tokens outgrow the pool
