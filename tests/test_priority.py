"""Priority scheduling without a model: the queue's order (high values first, or low with
--schedule-low-priority-values-first), preemption past the threshold only, and that a
preempted low-priority request still finishes with all its tokens."""

from __future__ import annotations

import pytest

from fixtures.sched import Harness

LOOPS = {"normal": True, "overlap": False}  # value: disable_overlap_schedule


@pytest.mark.parametrize("low_first, order", [(False, "bca"), (True, "acb")])
def test_order(core, low_first, order):
    h = Harness(
        core,
        max_running_requests=1,
        enable_priority_scheduling=True,
        schedule_low_priority_values_first=low_first,
    )
    for rid, prio in (("a", 0), ("b", 5), ("c", 1)):
        h.add(rid, [ord(rid)] * 6, priority=prio)
    h.run()
    assert "".join(h.admission_order()) == order


def test_priority_is_ignored_when_off(core):
    h = Harness(core, max_running_requests=1)
    for rid, prio in (("a", 0), ("b", 5), ("c", 1)):
        h.add(rid, [ord(rid)] * 6, priority=prio)
    h.run()
    assert h.admission_order() == ["a", "b", "c"]


def preempt(core, loop: str, high_priority: int, **args) -> Harness:
    """A low-priority request (0) holds most of a 1,000-token budget; a second one arrives."""
    h = Harness(
        core,
        total_tokens=1000,
        enable_priority_scheduling=True,
        disable_overlap_schedule=LOOPS[loop],
        **args,
    )
    h.add("low", [5] * 10, max_new_tokens=600, ignore_eos=True, priority=0)
    for _ in range(5):
        h.sched.step()
    h.add("high", [6] * 10, max_new_tokens=500, ignore_eos=True, priority=high_priority)
    h.run()
    return h


@pytest.mark.parametrize("loop", LOOPS)
def test_preemption_and_the_low_one_still_finishes(core, loop):
    h = preempt(core, loop, high_priority=100)
    assert h.sched.counters["num_preempted_reqs"] == 1
    finished = [rid for msg in h.outputs for rid, f in zip(msg.rids, msg.finished_reasons) if f]
    assert finished == ["high", "low"]
    results = h.results()
    assert results["low"]["finish"] == {"type": "length", "length": 600}
    assert len(results["low"]["ids"]) == 600 and results["low"]["n_finish"] == 1


@pytest.mark.parametrize(
    "high_priority, args",
    [(10, {}), (100, {"disable_priority_preemption": True}), (100, {"priority_scheduling_preemption_threshold": 100})],
)  # fmt: skip
def test_no_preemption_within_the_threshold_or_when_disabled(core, high_priority, args):
    h = preempt(core, "normal", high_priority, **args)
    assert h.sched.counters.get("num_preempted_reqs", 0) == 0
    finished = [rid for msg in h.outputs for rid, f in zip(msg.rids, msg.finished_reasons) if f]
    assert finished == ["low", "high"]


def test_the_priority_field_at_the_http_edge():
    """Native and OpenAI bodies carry an int `priority`; anything else fails validation (a 400
    at the edge, as every field of these strict models)."""
    from pydantic import ValidationError

    from sglite.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest

    assert GenerateRequest.model_validate({"text": "x", "priority": 3}).priority == 3
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x"}).priority is None
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "priority": -2}
    assert ChatCompletionRequest.model_validate(chat).priority == -2
    for bad in ("high", 1.5, True):
        with pytest.raises(ValidationError):
            GenerateRequest.model_validate({"text": "x", "priority": bad})
