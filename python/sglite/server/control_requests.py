"""ControlRequests: the TokenizerManager's round trips to every scheduler replica (stats, cache
flush), each answered per replica and merged (server/dp_dispatcher.py).

A mixin: it uses the manager's `dp_size`, `_waiters` (reply type and rank -> futures, filled by
the receive loop), `_send_retrying`, `dispatcher` and `metrics`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from sglite.messages import FlushCacheReq, FlushCacheResp, GetStatsReq, StatsResp
from sglite.server.dp_dispatcher import merge_flush, merge_stats
from sglite.server.errors import RequestError

CONTROL_TIMEOUT_S = 10.0
CONTROL_REPLIES = (FlushCacheResp, StatsResp)  # the reply types the receive loop routes here


class ControlRequests:
    async def _control(self, req: Any, reply_type: type) -> list[Any]:
        """Ask every replica; their replies in replica order."""
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in range(self.dp_size)]
        for rank, fut in enumerate(futs):
            self._waiters[(reply_type, rank)].append(fut)
        try:
            await self._send_retrying(req)
            return await asyncio.wait_for(asyncio.gather(*futs), CONTROL_TIMEOUT_S)
        except TimeoutError:
            raise RequestError("the scheduler did not answer in time", 503) from None

    async def get_replica_stats(self) -> list[dict[str, Any]]:
        """Each replica's scheduler stats (with its dp_rank and the dispatcher's counts);
        also refreshes the metrics' gauges with their sum."""
        per_replica = self.dispatcher.replica_stats(await self._control(GetStatsReq(), StatsResp))
        self.metrics.update_from_stats(merge_stats(per_replica))
        return per_replica

    async def get_stats(self) -> dict[str, Any]:
        """The scheduler stats of the whole server (summed over the replicas)."""
        return merge_stats(await self.get_replica_stats())

    async def flush_cache(self) -> FlushCacheResp:
        return merge_flush(await self._control(FlushCacheReq(), FlushCacheResp))
