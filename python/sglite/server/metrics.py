"""Prometheus metrics of the server: request latencies, token counts, scheduler gauges.

Latency and token metrics are observed by the TokenizerManager as outputs arrive; the
scheduler gauges (running/waiting requests, KV usage, cache hit rate) are refreshed from a
StatsResp when /metrics is scraped. Each server owns its registry (no global state).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 (re-export)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

THROUGHPUT_WINDOW_S = 10.0
_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_GAUGES = {
    "num_running_reqs": "Requests in the running batch.",
    "num_waiting_reqs": "Requests waiting to be scheduled.",
    "kv_used_tokens": "KV-cache slots in use (requests and cached prefixes).",
    "kv_total_tokens": "KV-cache capacity in tokens.",
    "token_usage": "Fraction of the KV cache in use.",
    "cache_hit_rate": "Prompt tokens served from the prefix cache / prompt tokens.",
}


class ServerMetrics:
    """Counters, histograms and gauges, rendered in the Prometheus text format."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        r, labels = self.registry, {"model_name": model_name}
        names = ("model_name",)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"sglite:{name}", doc, names, registry=r).labels(**labels)

        def hist(name: str, doc: str) -> Any:
            return Histogram(
                f"sglite:{name}", doc, names, buckets=_LATENCY_BUCKETS, registry=r
            ).labels(**labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"sglite:{name}", doc, names, registry=r).labels(**labels)

        self.gauges = {k: gauge(k, doc) for k, doc in _GAUGES.items()}
        self.gen_throughput = gauge(
            "gen_throughput",
            f"Generated tokens per second over the last {THROUGHPUT_WINDOW_S:.0f} s.",
        )
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_requests = counter("num_requests", "Finished requests.")
        self._recent: deque[tuple[float, int]] = deque()

    def on_tokens(self, num_tokens: int, since_last_s: float | None, ttft_s: float | None) -> None:
        """New output tokens of one request; `since_last_s` spans all of them."""
        if num_tokens <= 0:
            return
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if since_last_s is not None:
            per_token = since_last_s / num_tokens
            for _ in range(num_tokens):
                self.itl.observe(per_token)
        self.generation_tokens.inc(num_tokens)
        now = time.monotonic()
        self._recent.append((now, num_tokens))
        self._trim(now)

    def on_finish(self, prompt_tokens: int, e2e_s: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.num_requests.inc()
        self.e2e.observe(e2e_s)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def update_from_stats(self, stats: dict[str, Any]) -> None:
        for key, g in self.gauges.items():
            if key in stats and stats[key] is not None:
                g.set(float(stats[key]))
        total = stats.get("kv_total_tokens") or 0
        if "token_usage" not in stats and total:
            self.gauges["token_usage"].set(stats.get("kv_used_tokens", 0) / total)

    def render(self) -> bytes:
        now = time.monotonic()
        self._trim(now)
        self.gen_throughput.set(sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S)
        return generate_latest(self.registry)
