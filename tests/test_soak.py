"""A short soak of the real server on SmolLM2 (the long one is benches/soak.py).

The soak's server set-up (page size 16, mixed chunks, overlap loop, a 2048-token KV pool,
64-token chunks, --debug-invariants) under 64 concurrent mixed requests (24 at a time, at
most 16 new tokens each): no request may fail, and afterwards the server must be idle with
all KV free or evictable, healthy, unchanged in its greedy answers, free of tracebacks in
its log, and stop cleanly. The workload is seeded; outcomes do not depend on timing (a
client that hangs up may find its answer complete, which is then checked as an answer).
The classifier itself is tested on canned responses (no server, no model).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx
import pytest

from fixtures.soak_client import CHECKS, run_one, run_soak, server_flags
from fixtures.soak_workload import RequestSpec, SoakConfig, specs

CONFIG = SoakConfig(
    num_requests=64,
    concurrency=24,
    max_new_tokens=16,
    request_timeout_s=600.0,
    stall_timeout_s=60.0,
    idle_timeout_s=30.0,
    greedy_tokens=8,
)


@pytest.fixture(scope="module")
def report(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("soak") / "server.log"
    return run_soak(CONFIG, server_flags(smollm2_dir), log)


def test_workload_covers_every_kind():
    workload = list(specs(CONFIG, CONFIG.seed, CONFIG.num_requests, None))
    assert {s.api for s in workload} == {"generate", "completions", "chat", "bad"}
    assert any(s.stream for s in workload) and any(s.n > 1 for s in workload)
    assert any(s.stop for s in workload) and any(s.close_after for s in workload)
    assert any(s.max_new_tokens is None for s in workload)  # a request at the KV boundary
    assert any(s.logprobs for s in workload) and any(s.echo for s in workload)
    assert {s.api for s in workload if s.json_schema} >= {"generate", "chat"}


def test_no_request_failed(report):
    assert report.counts["ok"] > 0 and report.counts["4xx"] > 0, report.summary()
    assert not report.failures, f"{report.summary()}\n{report.problems()}"


@pytest.mark.parametrize("check", CHECKS)
def test_server_after_soak(report, check):
    assert report.checks.get(check) is None, f"{report.summary()}\n{report.checks[check]}"


# ---------------------------------------------------------------------- the classifier
def _sse(*events) -> bytes:
    return "".join(
        f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events
    ).encode()


def _gen(text: str, reason=None, n: int = 2) -> dict:
    meta = {"finish_reason": reason, "completion_tokens": n}
    return {"text": text, "output_ids": list(range(n)), "meta_info": meta}


LENGTH = {"type": "length", "length": 2}
STREAM = RequestSpec(0, "generate", stream=True, max_new_tokens=2)
PLAIN = RequestSpec(0, "generate", max_new_tokens=2)
BAD = RequestSpec(0, "bad", bad="bad_top_k")


@pytest.mark.parametrize(
    "spec,status,body,outcome,kind",
    [
        (PLAIN, 200, json.dumps(_gen("a b", LENGTH)).encode(), "ok", ""),
        (PLAIN, 503, b'{"error": {"message": "busy"}}', "failed", "http 503"),
        (PLAIN, 200, json.dumps(_gen("a b", None)).encode(), "failed", "missing finish reason"),
        (PLAIN, 200, json.dumps(_gen("a", LENGTH, 1)).encode(), "failed", "wrong output"),
        (STREAM, 200, _sse(_gen("a", None, 1), _gen("a b", LENGTH), "[DONE]"), "ok", ""),
        (STREAM, 200, _sse(_gen("a", None, 1), _gen("a b", LENGTH)), "failed", "malformed stream"),
        (STREAM, 200, _sse(_gen("a", None, 1), "[DONE]"), "failed", "missing finish reason"),
        (STREAM, 200, _sse(_gen("a", None, 1), _gen("b", LENGTH), "[DONE]"), "failed",
         "malformed stream"),
        (STREAM, 200, _sse({"error": {"message": "x", "code": 503}}, "[DONE]"), "failed",
         "stream error 503"),
        (replace(STREAM, close_after=1), 200, _sse(_gen("a", None, 1)), "disconnected", ""),
        (BAD, 400, b'{"error": {"message": "top_k: must be"}}', "4xx", ""),
        (BAD, 400, b"top_k is bad", "failed", "malformed response"),
        (BAD, 200, json.dumps(_gen("a b", LENGTH)).encode(), "failed", "bad input accepted"),
        (BAD, 500, b"Internal Server Error", "failed", "http 500"),
    ],
)  # fmt: skip
def test_classifier(spec, status, body, outcome, kind):
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))

    async def main():
        async with httpx.AsyncClient(transport=transport, base_url="http://soak") as client:
            return await run_one(client, spec, timeout_s=30)

    result = asyncio.run(main())
    assert (result.outcome, result.kind) == (outcome, kind), result.detail


def test_classifier_hang():
    async def never(request):
        await asyncio.Event().wait()

    async def main():
        transport = httpx.MockTransport(never)
        async with httpx.AsyncClient(transport=transport, base_url="http://soak") as client:
            return await run_one(client, PLAIN, timeout_s=0.1)

    assert asyncio.run(main()).kind == "hang"
