"""`/get_load`: the load report SGLang's router (`sglang-router`, the model gateway) polls
on each worker, in SGLang's shape.

GET /get_load -> [{"dp_rank": 0, "num_reqs": int, "num_waiting_reqs": int, "num_tokens": int}]

One entry per data-parallel rank (`--dp-size` replicas; the router sums them): `num_reqs`
counts running and waiting requests, `num_tokens` the KV tokens held by running requests
(the router's `power_of_two` policy compares workers by it; `/get_loads` on the router
lists it). The other routes the router calls (`/health`, `/server_info`, `/model_info`,
`/generate`, the OpenAI routes, `/flush_cache`) live in http_server.py.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI


def load_entry(stats: dict[str, Any], dp_rank: int = 0) -> dict[str, int]:
    """One rank's `/get_load` entry from its scheduler stats."""
    running = int(stats.get("num_running_reqs", 0))
    waiting = int(stats.get("num_waiting_reqs", 0))
    return {
        "dp_rank": dp_rank,
        "num_reqs": running + waiting,
        "num_waiting_reqs": waiting,
        "num_tokens": int(stats.get("kv_used_tokens", 0)),
    }


def add_router_routes(app: FastAPI, tm: Any) -> None:
    """Register the routes on `app`, answering from `tm`'s scheduler stats."""

    async def get_load() -> list[dict[str, int]]:
        replicas = await tm.get_replica_stats()
        return [load_entry(stats, stats.get("dp_rank", i)) for i, stats in enumerate(replicas)]

    app.add_api_route("/get_load", get_load, methods=["GET"])
