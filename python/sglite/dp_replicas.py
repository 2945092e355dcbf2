"""Scheduler processes: data-parallel replicas and tensor-parallel ranks, their names, IPC
inputs and heartbeats.

With `--dp-size N` the launcher starts N scheduler processes, each a full copy of the model
with its own KV pool and prefix tree, behind one TokenizerManager and one detokenizer.
Replica i reads its requests from its own input socket (`replica_ipc`); all replicas push
token ids to the one detokenizer and control replies (tagged with their `dp_rank`) to the
TokenizerManager, whose dispatcher (server/dp_dispatcher.py) picks a replica per request.
With `--dp-size 1` every name and address is the single-scheduler one, unchanged.

With `--tp-size N` (and --dp-size 1) the N scheduler processes are the ranks of one model:
"scheduler_tp{r}", each node starting its own ranks; only rank 0 reads the input socket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from sglite.ipc import IpcNames
from sglite.scheduler.watchdog import Heartbeat

SCHEDULER = "scheduler"


def replica_name(rank: int, dp_size: int) -> str:
    """The process-group key of replica `rank` ("scheduler" when there is only one)."""
    return SCHEDULER if dp_size == 1 else f"{SCHEDULER}_dp{rank}"


def tp_rank_name(tp_rank: int) -> str:
    """The process-group key of tensor-parallel rank `tp_rank` (tp_size > 1)."""
    return f"{SCHEDULER}_tp{tp_rank}"


def scheduler_names(dp_size: int, tp_ranks: Sequence[int] = (0,), tp_size: int = 1) -> list[str]:
    """The scheduler processes a node starts: its TP ranks, else the DP replicas."""
    if tp_size > 1:
        return [tp_rank_name(r) for r in tp_ranks]
    return [replica_name(rank, dp_size) for rank in range(dp_size)]


def replica_rank(name: str) -> int | None:
    """The rank of a scheduler process-group key; None for other processes."""
    if name == SCHEDULER:
        return 0
    prefix = f"{SCHEDULER}_dp"
    return int(name[len(prefix) :]) if name.startswith(prefix) else None


def tp_rank_of(name: str) -> int | None:
    """The TP rank of a scheduler process-group key; None for other processes."""
    prefix = f"{SCHEDULER}_tp"
    return int(name[len(prefix) :]) if name.startswith(prefix) else None


def is_scheduler(name: str) -> bool:
    return replica_rank(name) is not None or tp_rank_of(name) is not None


def describe_process(name: str) -> str:
    """How a log line names a child process: "the scheduler process", "the scheduler
    process of data-parallel replica 1", "the scheduler process of TP rank 1", "the
    detokenizer process"."""
    tp_rank = tp_rank_of(name)
    if tp_rank is not None:
        return f"the {SCHEDULER} process of TP rank {tp_rank}"
    rank = replica_rank(name)
    if rank is None or name == SCHEDULER:
        return f"the {name} process"
    return f"the {SCHEDULER} process of data-parallel replica {rank}"


def replica_input(ipc: IpcNames, rank: int, dp_size: int) -> str:
    """The address replica `rank` reads its requests from."""
    return ipc.scheduler_input if dp_size == 1 else f"{ipc.scheduler_input}{rank}"


def replica_inputs(ipc: IpcNames, dp_size: int) -> list[str]:
    return [replica_input(ipc, rank, dp_size) for rank in range(dp_size)]


def replica_ipc(ipc: IpcNames, rank: int, dp_size: int) -> IpcNames:
    """The IPC names a replica's scheduler process uses (its own input, shared outputs)."""
    if dp_size == 1:
        return ipc
    return dataclasses.replace(ipc, scheduler_input=replica_input(ipc, rank, dp_size))


class HeartbeatGroup:
    """The replicas' heartbeats read as one: the longest-running current step counts (one
    stuck replica makes the server unhealthy)."""

    def __init__(self, heartbeats: Sequence[Heartbeat]):
        self.heartbeats = list(heartbeats)

    def busy_for(self, now: float) -> float:
        return max(h.busy_for(now) for h in self.heartbeats)
