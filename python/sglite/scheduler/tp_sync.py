"""TPSync: every tensor-parallel rank's scheduler gets the same inputs, once per tick.

Under `--tp-size N` each rank runs its own Scheduler over its shard of the model, and all of
them must make the same decisions (same waiting queue, radix tree, allocator, batches) for
their forwards to meet in the same collectives. So only rank 0 reads the ZMQ input socket:
each tick it broadcasts the messages that arrived (one pickled list over the TP group's CPU
group; an empty tick is a single 8-byte broadcast) and every rank handles that list.

- Ticks never stop: while idle rank 0 waits for messages at most `idle_tick_s` (well below
  --dist-timeout), then broadcasts an empty list, so a rank waiting in the broadcast is
  never taken for dead.
- Decisions that depend on the clock (a grammar compiled or timed out) are taken on rank 0
  and shared with `agree` at a point every rank reaches in the same tick. Everything else
  the scheduler decides is a function of the messages and of the sampled tokens, which rank
  0 samples and broadcasts (ModelRunner.sample).
- Only rank 0 sends: the other ranks' scheduler outputs and control replies go nowhere.
- Stopping: SIGTERM (or Ctrl-C through the launcher) on any rank only raises its
  `stop_requested`; the next tick's broadcast tells every rank, and all of them exit with
  code 0 at that same point (`TPStopped`), so a node's launcher stops the whole group cleanly.
- A collective that fails (a peer died, or did not answer within --dist-timeout) raises
  `TPPeerLost`, whose message names this rank and the peers it lost; the process logs it
  and exits with PEER_LOST_EXIT_CODE.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglite.messages import decode, encode

if TYPE_CHECKING:
    from sglite.distributed import TPGroup

logger = logging.getLogger(__name__)

MAX_IDLE_TICK_S = 1.0
PEER_LOST_EXIT_CODE = 76  # a rank that lost a peer exits so (the launcher says so)
# what gloo and NCCL say when a peer's connection is gone or a collective timed out
_PEER_ERRORS = ("connection", "closed", "timed out", "timeout", "reset by peer", "broken pipe")


class TPPeerLost(RuntimeError):
    """A collective with the other TP ranks failed; the message names them."""


class TPStopped(SystemExit):
    """A rank was asked to stop: every rank leaves its loop at the same tick (exit code 0)."""

    def __init__(self) -> None:
        super().__init__(0)


def idle_tick_s(dist_timeout: float) -> float:
    """How long rank 0 waits for messages before it broadcasts an empty tick."""
    return min(MAX_IDLE_TICK_S, dist_timeout / 4)


class TPSync:
    """Rank 0's inputs on every rank. `group` is the model's TPGroup (tp_size > 1)."""

    def __init__(self, group: TPGroup, dist_timeout: float):
        self.group = group
        self.rank, self.size = group.rank, group.size
        self.dist_timeout = dist_timeout
        self.stop_requested = False  # set from a signal handler; read at the next share()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def share(self, local: Any) -> Any:
        """Rank 0's `local` on every rank (a collective; the others pass a placeholder of
        the same type, whose empty value stands for an empty message)."""
        data = encode(local) if self.is_leader and local else None
        try:
            out, stop = self.group.broadcast_bytes(data, self.stop_requested)
        except RuntimeError as e:
            raise TPPeerLost(self.lost_message(e, peers=[0] if self.rank else None)) from e
        if stop:
            logger.info("TP rank %d: the TP group was asked to stop; exiting", self.rank)
            raise TPStopped
        if self.is_leader:
            return local
        return decode(out) if out else type(local)()

    def recv(self, leader_recv: Callable[[bool], list]) -> Callable[[bool], list]:
        """The scheduler's `recv(block)`: rank 0 reads with `leader_recv` (which must return
        within `idle_tick_s` when blocking), every rank returns rank 0's messages."""

        def recv(block: bool) -> list:
            return self.share(leader_recv(block) if self.is_leader else [])

        return recv

    def lost_message(self, error: BaseException, peers: list[int] | None = None) -> str:
        """The sentence for a failed collective: who this is, whom it lost, the cause."""
        if peers is None:
            peers = [r for r in range(self.size) if r != self.rank]
        who = "TP rank " if len(peers) == 1 else "one of TP ranks "
        return (
            f"TP rank {self.rank}: lost contact with {who}{', '.join(map(str, peers))}: it "
            f"died or did not answer within --dist-timeout {self.dist_timeout:g} s ({error})"
        )


def is_peer_failure(error: BaseException) -> bool:
    """Whether `error`, raised by a collective, means a peer rank is gone."""
    if isinstance(error, TPPeerLost):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(word in text for word in _PEER_ERRORS)
