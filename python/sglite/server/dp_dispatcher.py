"""The data-parallel dispatcher: the TokenizerManager's sockets to the scheduler replicas,
which replica each message goes to, and the replicas' replies merged into one.

A GenerateReq goes to the one replica its load-balancing policy (server/load_balance.py)
chooses; the choice is remembered by request id until the TokenizerManager reports the
request finished (`done`), which also gives the in-flight counts `shortest_queue` and
`cache_aware` read. Everything else reaches every replica: aborts (by prefix, all, or an
exact id: the scheduler ignores ids it does not have), cache flushes and stats requests,
whose replies (tagged with the replica's `dp_rank`) `merge_stats` and `merge_flush` fold
into the single-server shape. With one replica this is a single PUSH socket.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

from sglite.dp_replicas import replica_inputs
from sglite.ipc import IpcNames, Sender
from sglite.messages import FlushCacheResp, GenerateReq, StatsResp
from sglite.server.load_balance import LoadBalancer, create_load_balancer

# per-replica stats that are not summed over the replicas
_RATIOS = {
    # key: (numerator, denominator), recomputed from the sums
    "cache_hit_rate": ("num_cached_tokens_total", "num_prompt_tokens_total"),
    "kv_usage": ("kv_used_tokens", "kv_total_tokens"),
}
_MAXED = {"new_token_ratio", "uptime_s"}


class Dispatcher:
    """Routes the TokenizerManager's messages to N replica input sockets (see module doc).

    Routing state lives from construction; the sockets from `bind(ctx)` to `close()`."""

    def __init__(self, addrs: Sequence[str], balancer: LoadBalancer):
        if len(addrs) != balancer.num_replicas:
            raise ValueError(f"{len(addrs)} replica addresses for {balancer.num_replicas}")
        self.addrs = list(addrs)
        self.senders: list[Sender] = []
        self.balancer = balancer
        self.loads = [0] * len(addrs)  # in-flight requests per replica
        self.num_routed = [0] * len(addrs)  # requests ever routed per replica
        self.rank_of: dict[str, int] = {}

    @classmethod
    def for_server(
        cls, ipc: IpcNames | None, server_args: Any, kv_capacity: int | None
    ) -> Dispatcher:
        """The dispatcher of a server's --dp-size replicas (`kv_capacity`: one replica's)."""
        dp_size = int(getattr(server_args, "dp_size", 1))
        method = getattr(server_args, "load_balance_method", "round_robin")
        balancer = create_load_balancer(method, dp_size, kv_capacity)
        addrs = replica_inputs(ipc, dp_size) if ipc is not None else [""] * dp_size
        return cls(addrs, balancer)

    def bind(self, ctx: zmq.Context) -> None:
        self.senders = [Sender(ctx, addr, bind=True) for addr in self.addrs]

    @property
    def num_replicas(self) -> int:
        return len(self.addrs)

    def targets(self, msg: Any) -> list[int]:
        """The replicas `msg` goes to; routes a GenerateReq on first sight (a retried send
        keeps its replica)."""
        if not isinstance(msg, GenerateReq):
            return list(range(self.num_replicas))
        rank = self.rank_of.get(msg.rid)
        if rank is None:
            rank = self.balancer.choose(msg.input_ids, self.loads)
            self.rank_of[msg.rid] = rank
            self.loads[rank] += 1
            self.num_routed[rank] += 1
        return [rank]

    def send_to(self, rank: int, msg: Any) -> None:
        """Send without blocking; raises zmq.Again when replica `rank` is not connected."""
        self.senders[rank].send(msg)

    def send(self, msg: Any) -> bool:
        """Best effort to every target; False if some replica could not be reached."""
        ok = True
        for rank in self.targets(msg):
            try:
                self.send_to(rank, msg)
            except zmq.Again:
                ok = False
        return ok

    def done(self, rid: str) -> None:
        """Request `rid` finished (or was given up): it no longer loads its replica."""
        rank = self.rank_of.pop(rid, None)
        if rank is not None:
            self.loads[rank] -= 1

    def replica_stats(self, replies: Sequence[StatsResp]) -> list[dict[str, Any]]:
        """Each replica's stats; with several replicas, also its `dp_rank` and the
        dispatcher's counts for it (`num_routed_reqs`, `num_inflight_reqs`)."""
        if self.num_replicas == 1:
            return [r.stats for r in replies]
        return [
            {
                **r.stats,
                "dp_rank": r.dp_rank,
                "num_routed_reqs": self.num_routed[r.dp_rank],
                "num_inflight_reqs": self.loads[r.dp_rank],
            }
            for r in sorted(replies, key=lambda r: r.dp_rank)
        ]

    def close(self) -> None:
        for sender in self.senders:
            sender.close()
        self.senders = []


def merge_stats(per_replica: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One replica's stats dict for the whole server: numbers summed (counts, tokens,
    capacities), ratios recomputed from the sums, the step-ratio and uptime the largest,
    anything else (the tree core) from replica 0. One replica: its stats unchanged."""
    if len(per_replica) == 1:
        return dict(per_replica[0])
    merged: dict[str, Any] = {}
    for key, value in per_replica[0].items():
        values = [s.get(key) for s in per_replica]
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        if key in _RATIOS or not numeric:
            merged[key] = value
        elif key in _MAXED:
            merged[key] = max(values)
        else:
            merged[key] = sum(values)
    for key, (num, den) in _RATIOS.items():
        if key in merged and num in merged and den in merged:
            merged[key] = merged[num] / merged[den] if merged[den] else 0.0
    merged.pop("dp_rank", None)
    return merged


def merge_flush(replies: Sequence[FlushCacheResp]) -> FlushCacheResp:
    """Flushed only if every replica flushed; the message names the ones that refused."""
    failed = [r for r in replies if not r.success]
    if not failed:
        return FlushCacheResp(True)
    if len(replies) == 1:
        return failed[0]
    reasons = "; ".join(f"replica {r.dp_rank}: {r.message or 'refused'}" for r in failed)
    return FlushCacheResp(
        False, f"{len(failed)} of {len(replies)} replicas did not flush ({reasons})"
    )
