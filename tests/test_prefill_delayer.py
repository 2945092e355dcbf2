"""The prefill delayer's rule (table-driven, as SGLang's cases), its tracker, its liveness bound
in the scheduler (a prefill held by a permanent slot condition runs by the max-th pass), and
the decode turns (--prefill-decode-interval, --max-consecutive-prefill-batches)."""

from __future__ import annotations

import pytest

from fixtures.sched import Harness
from sglite.scheduler.decode_turns import DecodeTurns
from sglite.scheduler.prefill_delayer import (
    DelayerConfig,
    DelayState,
    PrefillBatchTracker,
    Row,
    negotiate,
)

CFG = DelayerConfig(max_running_requests=8, max_delay_passes=3)


def row(prefillable=True, force=False, running=0, largest=0, waiting=1, timed_out=False):
    return Row(prefillable, force, running, largest, waiting, timed_out)


def decide(rows, prev=None, cfg=CFG, skip_first=False, now=0.0):
    return negotiate(prev, rows, cfg, skip_first, now)


def test_all_none_and_mixed():
    assert decide([row(), row()])[1:4] == (True, "no_wait", "all")
    assert decide([row(False), row(False)], prev=DelayState(2, 0.0)) == (
        None, True, "", "none", False,
    )  # fmt: skip
    state, allow, reason, est, _ = decide([row(), row(False)])
    assert (allow, reason, est) == (False, "delay", "mixed") and state == DelayState(1, 0.0)
    assert decide([row(), row()], prev=state)[1:3] == (True, "wait_success")


def test_the_watermark_forces_a_prefill_through():
    assert decide([row(force=True), row(False)])[1:3] == (True, "token_watermark")
    assert decide([row(force=True, running=8, largest=4)])[1:3] == (True, "token_watermark")


def test_delays_are_bounded_in_passes():
    state, verdicts = None, []
    for now in range(4):
        state, allow, reason, _, _ = decide([row(), row(False)], prev=state, now=now)
        verdicts.append(reason)
    assert verdicts == ["delay", "delay", "wait_timeout", "delay"]  # count reset on allow


def test_slot_condition_and_first_firing():
    full = [row(running=6, largest=4)]  # 2 free slots < a recent batch of 4
    assert decide(full, skip_first=True) == (None, True, "no_wait", "all", False)
    assert decide(full)[1:3] == (False, "delay")
    assert decide([row(running=4, largest=4)])[1:3] == (True, "no_wait")
    # without DP attention max_running is divided among DP ranks, rounded up
    dp = DelayerConfig(max_running_requests=9, max_delay_passes=3, num_dp_ranks=2)
    assert decide([row(running=1, largest=4)], cfg=dp)[1] is True  # 5 - 1 >= 4
    assert decide([row(running=2, largest=4)], cfg=dp)[1] is False


def test_queue_condition_and_its_timeout():
    cfg = DelayerConfig(max_running_requests=100, max_delay_passes=30, queue_min_ratio=0.5)
    assert decide([row(running=8, largest=2, waiting=1)], cfg=cfg)[1:3] == (False, "delay")
    assert decide([row(running=8, largest=2, waiting=2)], cfg=cfg)[1] is True
    assert decide([row(running=8, largest=2, waiting=1, timed_out=True)], cfg=cfg)[1] is True
    assert decide([row(running=0, largest=2, waiting=0)], cfg=cfg)[1] is True  # nothing runs
    capped = DelayerConfig(100, 30, queue_min_ratio=0.5, prefill_max_requests=1)
    assert decide([row(running=8, largest=4, waiting=1)], cfg=capped)[1] is True


def test_tracker_window():
    t = PrefillBatchTracker(window=4)
    for size in (100, 1, 2, 0, 3):
        t.record(size)
    assert t.max_prefill_bs == 100
    t.record(1)
    assert t.max_prefill_bs == 3  # the spike left the window; empty attempts do not age it
    with pytest.raises(ValueError):
        PrefillBatchTracker(window=0)


def passes_until_admitted(core, **args) -> int:
    """6 requests run (a batch of 6); a 7th passes on the first firing; an 8th then waits for
    2 free slots < 6 (the slot condition holds as long as the 7 run). Passes until admitted."""
    h = Harness(core, max_running_requests=8, disable_overlap_schedule=True, **args)
    for i in range(6):
        h.add(f"run{i}", [5] * 4, max_new_tokens=500)
    h.sched.step()
    h.add("seventh", [6] * 4, max_new_tokens=500)
    h.sched.step()
    assert len(h.sched.running) == 7
    h.add("late", [7] * 4, max_new_tokens=8)
    for n in range(1, 100):
        h.sched.step()
        if not h.sched.waiting:
            return n
    raise AssertionError("never admitted")


def test_liveness_in_the_scheduler(core):
    assert passes_until_admitted(core) == 1
    on = {"enable_prefill_delayer": True}
    assert passes_until_admitted(core, **on, prefill_delayer_max_delay_passes=5) == 5
    # default bound 30; here the tracker's window (16) forgets the batch of 6 first: each held
    # pass records its attempted size, min(waiting, free slots) = 1, and 2 free slots >= 1
    assert passes_until_admitted(core, **on) == 16
    forced = passes_until_admitted(core, **on, prefill_delayer_token_usage_low_watermark=0.9)
    assert forced == 1


def test_decode_turns_rules():
    t = DecodeTurns(interval=2, max_consecutive=0)
    t.ran(True)
    assert not t.may_prefill(True) and t.may_prefill(False)  # idle: never waits
    t.ran(False)
    assert not t.may_prefill(True)
    t.ran(False)
    assert t.may_prefill(True)
    k = DecodeTurns(interval=0, max_consecutive=2)
    k.ran(True)
    assert k.may_prefill(True)
    k.ran(True)
    assert not k.may_prefill(True)
    k.ran(False)
    assert k.may_prefill(True)


@pytest.mark.parametrize("args, kinds", [
    ({}, "PPPPP"),
    ({"prefill_decode_interval": 2}, "PDDPD"),
    ({"max_consecutive_prefill_batches": 1}, "PDPDP"),
])  # fmt: skip
def test_decode_turns_in_the_scheduler(core, args, kinds):
    """One request arrives per round; P: a prefill batch ran, D: a decode batch."""
    h = Harness(core, disable_overlap_schedule=True, max_prefill_tokens=4, **args)
    seen = ""
    for i in range(len(kinds)):
        h.add(f"r{i}", [5 + i] * 4, max_new_tokens=50)
        before = h.sched.counters["num_prefill_batches"]
        h.sched.step()
        seen += "P" if h.sched.counters["num_prefill_batches"] > before else "D"
    assert seen == kinds


@pytest.mark.parametrize("n, admitted_at_once", [(None, True), (1, True), (2, False), (9, False)])
def test_min_free_slots_delay(core, n, admitted_at_once):
    """3 of 4 slots run; a new request waits for min(N, 4) free slots (N <= 1: off), i.e. for
    the shortest running one to finish."""
    h = Harness(core, max_running_requests=4, min_free_slots_delay=n, disable_overlap_schedule=True)
    for i, max_new in enumerate((5, 50, 50)):
        h.add(f"run{i}", [5 + i] * 4, max_new_tokens=max_new)
    h.sched.step()
    h.add("new", [9] * 4)
    h.sched.step()
    assert (not h.sched.waiting) == admitted_at_once
    h.run()
    assert h.results()["new"]["finish"]["type"] == "length"


def test_outcomes_are_counted_with_sglangs_labels(core):
    h = Harness(core, enable_prefill_delayer=True, prefill_delayer_max_delay_passes=2)
    h.add("a", [5] * 4)
    h.run()
    outcomes = h.sched.stats()["prefill_delayer_outcomes"]
    assert {"input_estimation": "all", "output_allow": True, "output_reason": "no_wait"} in [
        {k: v for k, v in o.items() if k != "count"} for o in outcomes
    ]
    assert "prefill_delayer_outcomes" not in Harness(core).sched.stats()
