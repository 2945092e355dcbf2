"""Prometheus metrics under SGLang's names (`sglang:*`, label `model_name`), so SGLang's
Grafana dashboard and alerts read an sglite server unchanged.

Latency and token metrics are observed by the TokenizerManager as outputs arrive, for every
request, streamed or not (the scheduler sends every request's first token as soon as it
exists, so TTFT is real for non-streamed requests too); the scheduler gauges (running and
queued requests, KV tokens in use, cache hit rate) are refreshed from a StatsResp when
/metrics is scraped. `--enable-metrics` off gives `NullMetrics`, which records nothing (and
/metrics answers 404). Each server owns its registry (no global state).

| metric                                  | kind      | meaning                               |
|-----------------------------------------|-----------|---------------------------------------|
| sglang:num_running_reqs                 | gauge     | requests in the running batch         |
| sglang:num_queue_reqs                   | gauge     | requests waiting to be scheduled      |
| sglang:num_used_tokens                  | gauge     | KV slots in use (requests + cache)    |
| sglang:token_usage                      | gauge     | num_used_tokens / KV capacity         |
| sglang:cache_hit_rate                   | gauge     | prompt tokens from the prefix cache   |
| sglang:gen_throughput                   | gauge     | output tokens/s over the last 10 s    |
| sglang:prompt_tokens_total              | counter   | prompt tokens of finished requests    |
| sglang:generation_tokens_total          | counter   | output tokens                         |
| sglang:num_requests_total               | counter   | finished requests                     |
| sglang:time_to_first_token_seconds      | histogram | arrival to first output token         |
| sglang:inter_token_latency_seconds      | histogram | gap between output tokens             |
| sglang:e2e_request_latency_seconds      | histogram | arrival to finish                     |
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 (re-export)
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

PREFIX = "sglang:"
THROUGHPUT_WINDOW_S = 10.0
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
_TTFT_BUCKETS += (2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 25.0, 30.0, 40.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04)
_ITL_BUCKETS += (0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
_E2E_BUCKETS += (90.0, 120.0, 180.0, 300.0, 600.0, 1200.0, 2400.0)
# gauge name -> (key in the scheduler's stats, help)
_GAUGES = {
    "num_running_reqs": ("num_running_reqs", "The number of running requests."),
    "num_queue_reqs": ("num_waiting_reqs", "The number of requests in the waiting queue."),
    "num_used_tokens": ("kv_used_tokens", "The number of used KV-cache tokens."),
    "token_usage": (None, "The token usage (used KV-cache tokens / capacity)."),
    "cache_hit_rate": ("cache_hit_rate", "The prefix-cache hit rate (prompt tokens)."),
    "hicache_host_used_tokens": (
        "hicache_host_used_tokens",
        "The number of tokens in the HiCache host pool.",
    ),
    "hicache_host_total_tokens": (
        "hicache_host_total_tokens",
        "The capacity of the HiCache host pool in tokens.",
    ),
}
# counter name (prometheus_client appends _total) -> (running total in the stats, help)
_TOTALS = {
    "evicted_tokens": ("num_evicted_tokens", "Number of tokens evicted from the device KV pool."),
    "load_back_tokens": (
        "num_load_back_tokens",
        "Number of tokens loaded back from the HiCache host pool to the device.",
    ),
}


class NullMetrics:
    """Metrics off (no --enable-metrics): every observation is dropped."""

    enabled = False

    def on_tokens(self, num_tokens: int, since_last_s: float | None, ttft_s: float | None) -> None:
        pass

    def on_finish(self, prompt_tokens: int, e2e_s: float) -> None:
        pass

    def update_from_stats(self, stats: dict[str, Any]) -> None:
        pass

    def render(self) -> bytes:
        return b""


class ServerMetrics(NullMetrics):
    """Counters, histograms and gauges, rendered in the Prometheus text format."""

    enabled = True

    def __init__(self, model_name: str):
        disable_created_metrics()  # no `*_created` series: SGLang exports none
        self.registry = CollectorRegistry(auto_describe=True)
        r, labels = self.registry, {"model_name": model_name}
        names = ("model_name",)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, names, registry=r).labels(**labels)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=r).labels(
                **labels
            )

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, names, registry=r).labels(**labels)

        self.gauges = {name: gauge(name, doc) for name, (_, doc) in _GAUGES.items()}
        self.gen_throughput = gauge(
            "gen_throughput",
            f"The generation throughput (tokens/s, over the last {THROUGHPUT_WINDOW_S:.0f} s).",
        )
        self.ttft = hist(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )
        self.itl = hist(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )
        self.e2e = hist(
            "e2e_request_latency_seconds",
            "Histogram of end-to-end request latency in seconds.",
            _E2E_BUCKETS,
        )
        # prometheus_client appends `_total` to counter names
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "generation_tokens", "Number of generation tokens processed."
        )
        self.num_requests = counter("num_requests", "Number of requests processed.")
        self.totals = {name: counter(name, doc) for name, (_, doc) in _TOTALS.items()}
        self._last_totals = dict.fromkeys(_TOTALS, 0)
        self._recent: deque[tuple[float, int]] = deque()

    def on_tokens(self, num_tokens: int, since_last_s: float | None, ttft_s: float | None) -> None:
        """New output tokens of one request: its first ones (`ttft_s` after it arrived) or
        later ones, `since_last_s` after its previous output (each token gets an equal share
        of the gap)."""
        if num_tokens <= 0:
            return
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        elif since_last_s is not None:
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
        for name, (key, _) in _GAUGES.items():
            if key is not None and stats.get(key) is not None:
                self.gauges[name].set(float(stats[key]))
        for name, (key, _) in _TOTALS.items():  # the scheduler keeps running totals
            value = stats.get(key)
            if value is not None and value > self._last_totals[name]:
                self.totals[name].inc(value - self._last_totals[name])
                self._last_totals[name] = value
        total = stats.get("kv_total_tokens") or 0
        if total:
            self.gauges["token_usage"].set(stats.get("kv_used_tokens", 0) / total)

    def render(self) -> bytes:
        now = time.monotonic()
        self._trim(now)
        self.gen_throughput.set(sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S)
        return generate_latest(self.registry)


def create_metrics(enabled: bool, model_name: str) -> NullMetrics:
    return ServerMetrics(model_name) if enabled else NullMetrics()
