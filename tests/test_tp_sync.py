"""TPSync and the grammar gate under TP, without processes: a fake group stands for the
broadcast. Every rank hands back rank 0's messages (an empty tick too), a stop asked on any
rank ends every rank at the same tick, a failed collective names the lost rank, and the
grammar gate follows rank 0's verdicts even where this rank's own clock or compile disagree.
"""

from __future__ import annotations

import threading

import pytest

from fixtures.grammars import BlockingBackend, FakeClock, settle
from sglite.constrained.grammar_queue import READY, GrammarQueue
from sglite.messages import AbortReq, encode
from sglite.sampling_params import SamplingParams
from sglite.scheduler.req import Req
from sglite.scheduler.tp_sync import TPPeerLost, TPStopped, TPSync, idle_tick_s, is_peer_failure


class FakeGroup:
    """Rank `rank` of `size`; `broadcast_bytes` answers with what rank 0 "sent"."""

    def __init__(self, rank: int, size: int = 2, sent: bytes = b"", stop: bool = False):
        self.rank, self.size, self.sent, self.stop = rank, size, sent, stop
        self.error: Exception | None = None

    def broadcast_bytes(self, data, flag=False):
        if self.error is not None:
            raise self.error
        return (data or b"") if self.rank == 0 else self.sent, flag or self.stop


def test_every_rank_gets_rank_0s_messages_and_empty_ticks():
    msgs = [AbortReq("r1")]
    leader = TPSync(FakeGroup(0), 60)
    assert leader.recv(lambda block: msgs)(True) is msgs
    follower = TPSync(FakeGroup(1, sent=encode(msgs)), 60)
    assert follower.recv(lambda block: pytest.fail("only rank 0 reads"))(True) == msgs
    assert TPSync(FakeGroup(1), 60).recv(lambda block: [])(False) == []
    assert TPSync(FakeGroup(1), 60).share({}) == {}  # an empty verdict dict
    assert idle_tick_s(60) == 1.0 and idle_tick_s(2) == 0.5


def test_a_stop_on_any_rank_stops_every_rank():
    asked = TPSync(FakeGroup(1), 60)
    asked.stop_requested = True
    with pytest.raises(TPStopped) as e:
        asked.share([])
    assert e.value.code == 0
    with pytest.raises(TPStopped):  # rank 0 learns it from the same collective
        TPSync(FakeGroup(0, stop=True), 60).share([])


def test_a_failed_collective_names_the_lost_rank():
    group = FakeGroup(1, size=3)
    group.error = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    with pytest.raises(TPPeerLost, match="TP rank 1: lost contact with TP rank 0: .*closed"):
        TPSync(group, 10).share([])
    sync = TPSync(FakeGroup(0, size=3), 10)
    assert "lost contact with one of TP ranks 1, 2" in sync.lost_message(RuntimeError("x"))
    assert is_peer_failure(RuntimeError("Timed out waiting 10000ms for recv operation"))
    assert not is_peer_failure(ValueError("bad input"))


def _req(rid: str, regex: str) -> Req:
    return Req(rid, [1, 2, 3], SamplingParams(regex=regex, max_new_tokens=4))


def test_the_grammar_gate_follows_rank_0s_verdicts():
    clock = FakeClock()
    rank0 = {"a": (503, "did not compile in time"), "b": (READY, "")}
    queue = GrammarQueue(BlockingBackend(blocked=False), 5.0, clock=clock, agree=lambda v: rank0)
    for rid in "abc":
        queue.add(_req(rid, f"x{rid}"))
    settle(queue)  # every compile is done here: alone, this rank would admit all three
    ready, refused = queue.poll()
    assert [r.rid for r in ready] == ["b"] and ready[0].grammar is not None
    assert [(r.req.rid, r.status_code, r.message) for r in refused] == [
        ("a", 503, "did not compile in time")
    ]
    assert len(queue) == 1  # "c" waits for rank 0's word


def test_a_rank_told_ready_waits_for_its_own_compile():
    backend = BlockingBackend(blocked=True)
    queue = GrammarQueue(backend, 5.0, clock=FakeClock(), agree=lambda v: {"a": (READY, "")})
    queue.add(_req("a", "y"))
    # rank 0's compile was faster: this one's is still blocked when poll() starts
    threading.Timer(0.1, backend.release.set).start()
    ready, refused = queue.poll()
    assert [r.rid for r in ready] == ["a"] and not refused
