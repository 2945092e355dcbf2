"""Serving benchmark endpoints and cache probes.

Api and its subclasses build a streaming request for each route (OpenAI completions and chat,
SGLang-native /generate) and read its SSE payloads; CacheProbe and its subclasses read a
server's prefix-cache counters, from which measured_hit_rate takes a run's hit rate.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import httpx

from sglite.bench.datasets import RequestResult

Messages = list[dict[str, str]]


# ---------------------------------------------------------------------- endpoints
def flatten(messages: Messages) -> str:
    """A conversation as one text prompt, for the text APIs (no chat template)."""
    return "".join(m["content"] for m in messages)


def _openai_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": details.get("cached_tokens"),
    }


class Api(ABC):
    """One streaming endpoint. `body` builds the request for the conversation so far;
    `parse` reads one SSE payload into (new text, usage or None), usage mapping
    prompt_tokens, completion_tokens and cached_tokens (None where not reported)."""

    path: str

    @abstractmethod
    def body(self, messages: Messages, output_len: int, model: str, sampling: dict) -> dict: ...

    @abstractmethod
    def parse(self, data: dict, text_so_far: str) -> tuple[str, dict | None]: ...


class CompletionsApi(Api):
    path = "/v1/completions"

    def body(self, messages: Messages, output_len: int, model: str, sampling: dict) -> dict:
        return {
            "model": model,
            "prompt": flatten(messages),
            "max_tokens": output_len,
            "stream": True,
            "stream_options": {"include_usage": True},
            **sampling,
        }

    def parse(self, data: dict, text_so_far: str) -> tuple[str, dict | None]:
        text = "".join(c.get("text") or "" for c in data.get("choices") or [])
        return text, _openai_usage(data.get("usage"))


class ChatApi(Api):
    path = "/v1/chat/completions"

    def body(self, messages: Messages, output_len: int, model: str, sampling: dict) -> dict:
        return {
            "model": model,
            "messages": messages,
            "max_tokens": output_len,
            "stream": True,
            "stream_options": {"include_usage": True},
            **sampling,
        }

    def parse(self, data: dict, text_so_far: str) -> tuple[str, dict | None]:
        parts = [(c.get("delta") or {}).get("content") or "" for c in data.get("choices") or []]
        return "".join(parts), _openai_usage(data.get("usage"))


class GenerateApi(Api):
    """SGLang-native /generate: each chunk carries the whole text so far and meta_info."""

    path = "/generate"

    def body(self, messages: Messages, output_len: int, model: str, sampling: dict) -> dict:
        extra = {k: v for k, v in sampling.items() if k not in ("temperature", "ignore_eos")}
        params = {k: v for k, v in sampling.items() if k in ("temperature", "ignore_eos")}
        return {
            "text": flatten(messages),
            "stream": True,
            "sampling_params": {"max_new_tokens": output_len, **params},
            **extra,
        }

    def parse(self, data: dict, text_so_far: str) -> tuple[str, dict | None]:
        meta = data.get("meta_info") or {}
        usage = {k: meta.get(k) for k in ("prompt_tokens", "completion_tokens", "cached_tokens")}
        return (data.get("text") or "")[len(text_so_far) :], usage if meta else None


APIS: dict[str, type[Api]] = {
    "completions": CompletionsApi,
    "chat": ChatApi,
    "generate": GenerateApi,
}


# ---------------------------------------------------------------------- cache counters
def prometheus_sum(text: str, name: str) -> float | None:
    """The sum of a Prometheus sample over all its label sets; None if absent."""
    values = []
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            values.append(float(line.rsplit(None, 1)[-1]))
    return sum(values) if values else None


class CacheProbe(ABC):
    """Server-wide prefix-cache counters. `snapshot` returns (cached tokens, prompt tokens)
    so far, or None when the server does not tell; a run's rate is the ratio of deltas."""

    @abstractmethod
    async def snapshot(self, client: httpx.AsyncClient) -> tuple[float, float] | None: ...


class NullProbe(CacheProbe):
    async def snapshot(self, client: httpx.AsyncClient) -> tuple[float, float] | None:
        return None


class SgliteProbe(CacheProbe):
    async def snapshot(self, client: httpx.AsyncClient) -> tuple[float, float] | None:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            resp = await client.get("/get_server_info")
            stats = resp.raise_for_status().json()  # SGLang's flat shape: stats at the top
            return float(stats["num_cached_tokens_total"]), float(stats["num_prompt_tokens_total"])
        return None


class VllmProbe(CacheProbe):
    async def snapshot(self, client: httpx.AsyncClient) -> tuple[float, float] | None:
        with contextlib.suppress(httpx.HTTPError):
            text = (await client.get("/metrics")).raise_for_status().text
            hits = prometheus_sum(text, "vllm:prefix_cache_hits_total")
            queries = prometheus_sum(text, "vllm:prefix_cache_queries_total")
            return None if hits is None or queries is None else (hits, queries)
        return None


PROBES: dict[str, type[CacheProbe]] = {
    "sglite": SgliteProbe,
    "vllm": VllmProbe,
    "sglang": NullProbe,
    "openai": NullProbe,
}
FLUSH_PATHS = {"sglite": "/flush_cache", "sglang": "/flush_cache", "vllm": "/reset_prefix_cache"}


def measured_hit_rate(
    before: tuple[float, float] | None,
    after: tuple[float, float] | None,
    ok: Sequence[RequestResult],
) -> tuple[float | None, str]:
    """(rate, source): server counter deltas, else usage cached_tokens, else (None, "n/a")."""
    if before and after and after[1] > before[1]:
        return (after[0] - before[0]) / (after[1] - before[1]), "server counters"
    reported = [r for r in ok if r.cached_tokens is not None]
    prompt = sum(r.prompt_len for r in reported)
    if reported and prompt:
        return sum(r.cached_tokens or 0 for r in reported) / prompt, "usage cached_tokens"
    return None, "n/a"
