"""Serving benchmark client: streams a seeded workload to an HTTP server and reports latency.

    python -m sglite.bench_serving --backend sglite --dataset-name random --num-prompts 200 \
        --random-input-len 1024 --random-output-len 128 --max-concurrency 16 \
        --output-file bench_results/serving.jsonl --tag my-run

Targets sglite, SGLang (native /generate or OpenAI routes), vLLM or any OpenAI-compatible
server; flag names follow SGLang's bench_serving where it has them. Every request streams
and forces its output length (max_tokens + ignore_eos, temperature 0 by default).

Per request, TTFT, ITL and TPOT are as sglite.bench.datasets defines them; token counts come
from the server's usage (or meta_info), else from the tokenizer. A request that fails (HTTP
status, an error event in the stream, a dropped connection) is counted and listed, and left
out of the latency stats; a multi-turn conversation stops at its first failed turn and its
later turns count as failed. Warm-up requests use their own random prompts, so they warm no
prefix of the run.

Cache hit rate: deltas of the server's counters across the measured run (sglite:
/get_server_info counters; vLLM: /metrics prefix_cache_hits/queries), else the sum of
usage cached_tokens, else n/a. For generated-shared-prefix, the best rate any cache could
reach on the system prompts (sglite.bench.datasets.best_prefix_hit_rate) is printed beside it.

--output-file appends one JSON object per run as a line (sglite.bench.stats describes it),
which benches/report.py turns into tables and plots.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from sglite.bench.datasets import (
    DATASETS,
    Conversation,
    RequestResult,
    TextMaker,
    count_tokens,
    stable_token_ids,
)
from sglite.bench.endpoints import (
    APIS,
    FLUSH_PATHS,
    PROBES,
    Messages,
    flatten,
    measured_hit_rate,
)
from sglite.bench.stats import build_report, format_report


# ---------------------------------------------------------------------- client
class Runner:
    """Sends conversations (arrivals by --request-rate, at most --max-concurrency requests
    in flight, turns in order) and records every request, sent or not."""

    def __init__(
        self, client: httpx.AsyncClient, args: argparse.Namespace, model: str, tokenizer: Any
    ) -> None:
        self.client, self.model, self.tokenizer = client, model, tokenizer
        self.api = APIS[args.api]()
        self.sampling = {"temperature": args.temperature, **json.loads(args.extra_request_body)}
        if not args.disable_ignore_eos:
            self.sampling["ignore_eos"] = True
        cap = args.max_concurrency
        self.slots = asyncio.Semaphore(cap) if cap else contextlib.nullcontext()
        self.num_in_flight = self.peak_in_flight = 0
        self.on_done: Callable[[], Any] = lambda: None

    async def run(
        self, convs: Sequence[Conversation], rate: float, rng: random.Random
    ) -> list[RequestResult]:
        tasks = []
        for i, conv in enumerate(convs):
            tasks.append(asyncio.create_task(self.conversation(i, conv)))
            if math.isfinite(rate) and i + 1 < len(convs):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        return [r for results in await asyncio.gather(*tasks) for r in results]

    async def conversation(self, idx: int, conv: Conversation) -> list[RequestResult]:
        messages = [{"role": "system", "content": conv.system}] if conv.system else []
        results: list[RequestResult] = []
        for t, user in enumerate(conv.turns):
            messages.append({"role": "user", "content": user})
            r = RequestResult(idx, t, conv.group_idx)
            if results and not results[-1].ok:
                r.error = "not sent: the previous turn of its conversation failed"
            else:
                await self.send(r, messages, conv.output_len)
                if r.ok and not r.prompt_len:
                    first = conv.system_len + conv.turn_lens[0]
                    r.prompt_len = (
                        first if t == 0 else count_tokens(self.tokenizer, flatten(messages))
                    )
            results.append(r)
            messages.append({"role": "assistant", "content": r.text})
            self.on_done()
        return results

    async def send(self, r: RequestResult, messages: Messages, output_len: int) -> None:
        body = self.api.body(messages, output_len, self.model, self.sampling)
        usage: dict | None = None
        async with self.slots:
            self.num_in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.num_in_flight)
            r.start = time.perf_counter()
            try:
                usage = await self._stream(r, body)
            except (httpx.HTTPError, ValueError, LookupError, TypeError, AttributeError) as e:
                # a dropped connection or a malformed chunk fails this request, not the run
                r.error = f"{type(e).__name__}: {e}"
            finally:
                r.end = time.perf_counter()
                self.num_in_flight -= 1
        usage = usage or {}
        r.prompt_len = usage.get("prompt_tokens") or 0
        r.output_len = usage.get("completion_tokens") or count_tokens(self.tokenizer, r.text)
        r.cached_tokens = usage.get("cached_tokens")

    async def _stream(self, r: RequestResult, body: dict) -> dict | None:
        usage = None
        async with self.client.stream("POST", self.api.path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                r.error = f"HTTP {resp.status_code}: {text[:500]}"
                return None
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    r.error = f"error event in the stream: {json.dumps(data['error'])[:500]}"
                    return None
                delta, chunk_usage = self.api.parse(data, r.text)
                if delta:
                    r.chunk_times.append(now)
                    r.text += delta
                usage = chunk_usage or usage
        return usage


# ---------------------------------------------------------------------- orchestration
async def _server_model(client: httpx.AsyncClient) -> str:
    try:
        return (await client.get("/v1/models")).raise_for_status().json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise SystemExit(
            f"could not read the model name from GET /v1/models ({e}); pass --model"
        ) from None


async def _load_tokenizer(client: httpx.AsyncClient, path: str | None) -> Any:
    from transformers import AutoTokenizer

    if path is None:
        try:
            info = (await client.get("/get_model_info")).raise_for_status().json()
            path = info.get("tokenizer_path") or info["model_path"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise SystemExit(
                f"the server did not name its tokenizer (GET /get_model_info: {e}); "
                "pass --tokenizer PATH, a local HF tokenizer folder"
            ) from None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"could not load the tokenizer at {path!r} ({e}); "
            "pass --tokenizer PATH, a local HF tokenizer folder"
        ) from None


async def _warm_up(
    runner: Runner, args: argparse.Namespace, convs: Sequence[Conversation], maker: TextMaker
) -> None:
    first = convs[0]
    warm = []
    for _ in range(args.warmup_requests):
        text, n = maker.text(first.system_len + first.turn_lens[0])
        warm.append(Conversation([text], [n], min(first.output_len, 16)))
    results = await asyncio.gather(*(runner.conversation(i, c) for i, c in enumerate(warm)))
    failed = [r.error for rs in results for r in rs if not r.ok]
    if failed:
        raise SystemExit(
            f"warm-up request failed: {failed[0]}\ncheck --base-url, --backend, --api and --model"
        )


def base_url(args: argparse.Namespace) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    host = args.host if "://" in args.host else f"http://{args.host}"
    return f"{host}:{args.port}"


async def benchmark(args: argparse.Namespace) -> tuple[dict[str, Any], list[RequestResult]]:
    """Warm up, then run the workload once; returns the report and every request's record."""
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    async with httpx.AsyncClient(
        base_url=base_url(args),
        headers=headers,
        timeout=httpx.Timeout(None, connect=10.0),  # a long output may stream for minutes
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,  # no proxies between the client and the server it measures
    ) as client:
        model = args.model or await _server_model(client)
        tokenizer = await _load_tokenizer(client, args.tokenizer)
        ids = stable_token_ids(tokenizer)
        convs = DATASETS[args.dataset_name](
            args, TextMaker(tokenizer, random.Random(args.seed), ids)
        )
        runner = Runner(client, args, model, tokenizer)
        await _warm_up(runner, args, convs, TextMaker(tokenizer, random.Random(args.seed + 1), ids))
        if args.flush_cache and args.backend in FLUSH_PATHS:
            resp = await client.post(FLUSH_PATHS[args.backend])
            if resp.status_code != 200:
                print(
                    f"warning: cache flush answered {resp.status_code}: {resp.text}",
                    file=sys.stderr,
                )
        probe = PROBES[args.backend]()
        before = await probe.snapshot(client)
        total = sum(len(c.turns) for c in convs)
        with tqdm(total=total, disable=args.disable_tqdm, file=sys.stderr) as bar:
            runner.on_done = lambda: bar.update(1)
            runner.peak_in_flight = 0
            start = time.perf_counter()
            results = await runner.run(convs, args.request_rate, random.Random(args.seed + 2))
            duration = time.perf_counter() - start
        after = await probe.snapshot(client)
    hit = measured_hit_rate(before, after, [r for r in results if r.ok])
    return build_report(args, model, convs, results, duration, runner.peak_in_flight, hit), results


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sglite.bench_serving", description=__doc__.splitlines()[0]
    )
    add = p.add_argument
    add(
        "--backend",
        choices=sorted(PROBES),
        default="sglite",
        help="the server kind (picks the cache counters)",
    )
    add("--base-url", default=None, help="e.g. http://127.0.0.1:30000 (overrides --host/--port)")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000)
    add(
        "--api",
        choices=sorted(APIS),
        default="completions",
        help="generate = SGLang-native /generate",
    )
    add("--model", default=None, help="served model name (default: the first of GET /v1/models)")
    add("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    add(
        "--tokenizer",
        default=None,
        help="local HF tokenizer folder (default: the server's, from /get_model_info)",
    )
    add("--dataset-name", choices=sorted(DATASETS), default="random")
    add("--num-prompts", type=int, default=1000, help="requests of the random dataset")
    add("--random-input-len", type=int, default=1024)
    add("--random-output-len", type=int, default=1024)
    add("--random-range-ratio", type=float, default=0.0, help="lengths uniform in [len*ratio, len]")
    add("--gsp-num-groups", type=int, default=64)
    add("--gsp-prompts-per-group", type=int, default=16)
    add("--gsp-system-prompt-len", type=int, default=2048)
    add("--gsp-question-len", type=int, default=128)
    add("--gsp-output-len", type=int, default=256)
    add("--gsp-shuffle", action="store_true", help="shuffle requests across groups")
    add("--multi-turn-num-conversations", type=int, default=16)
    add("--multi-turn-turns", type=int, default=4)
    add("--multi-turn-input-len", type=int, default=256, help="tokens of each user turn")
    add("--multi-turn-output-len", type=int, default=128)
    add(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (inf: all at once)",
    )
    add("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    add("--seed", type=int, default=1)
    add("--temperature", type=float, default=0.0)
    add("--disable-ignore-eos", action="store_true", help="let requests stop at EOS")
    add("--extra-request-body", default="{}", help="JSON object merged into every request body")
    add("--warmup-requests", type=int, default=1)
    add(
        "--flush-cache",
        action="store_true",
        help="flush the server's prefix cache after the warm-up",
    )
    add("--output-file", default=None, help="append the result as one JSON line")
    add("--tag", default="", help="free text stored with the result")
    add("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    positive = (
        "num_prompts random_input_len random_output_len gsp_num_groups gsp_prompts_per_group "
        "gsp_system_prompt_len gsp_question_len gsp_output_len multi_turn_num_conversations "
        "multi_turn_turns multi_turn_input_len multi_turn_output_len"
    ).split()
    for name in positive:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        p.error(f"--random-range-ratio must be in [0, 1], got {args.random_range_ratio}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        p.error(f"--request-rate must be positive (inf: all at once), got {args.request_rate}")
    if args.warmup_requests < 0:
        p.error(f"--warmup-requests must be 0 or more, got {args.warmup_requests}")
    if args.api == "generate" and args.backend in ("vllm", "openai"):
        p.error(
            f"--api generate is SGLang's native route; {args.backend} serves completions or chat"
        )
    try:
        extra = json.loads(args.extra_request_body)
    except json.JSONDecodeError as e:
        p.error(f"--extra-request-body is not JSON: {e}")
    if not isinstance(extra, dict):
        p.error("--extra-request-body must be a JSON object")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report, _ = asyncio.run(benchmark(args))
    print(format_report(report))
    if args.output_file:
        path = Path(args.output_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(report) + "\n")
    return report


if __name__ == "__main__":
    main()
