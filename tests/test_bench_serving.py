"""sglite.bench_serving against an in-process fake server whose streams are known, plus the
pure pieces (percentiles, the best-possible hit rate, Prometheus parsing) and
benches/report.py. No network beyond 127.0.0.1, no model.

The fake answers every request with ceil(n / tokens_per_chunk) text chunks "w0 ", "w1 ", ...
(n = the requested output length), then a usage record (10 prompt tokens, 2 cached, n
completion tokens) unless told not to. Its server-wide counters grow by 10 prompt and 4
cached tokens per request, so a rate from them (0.4) differs from one from usage (0.2).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import random
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from sglite import bench_serving as bs
from sglite.bench.datasets import (
    Conversation,
    RequestResult,
    TextMaker,
    best_prefix_hit_rate,
    count_tokens,
    gsp_dataset,
)
from sglite.bench.endpoints import measured_hit_rate, prometheus_sum
from sglite.bench.stats import format_report, percentile, summarize

REPO = Path(__file__).resolve().parents[1]
PROMPT_TOKENS, USAGE_CACHED, SERVER_CACHED = 10, 2, 4


class Fake:
    def __init__(self, tok_dir: Path) -> None:
        self.tok_dir = tok_dir
        self.reset()

    def reset(self, **options: Any) -> None:
        self.tokens_per_chunk = options.get("tokens_per_chunk", 1)
        self.fail_every = options.get("fail_every", 0)  # every k-th request gets a 400
        self.hold = options.get("hold", 0)  # streams wait until this many were open at once
        self.send_usage = options.get("send_usage", True)
        self.num_requests = self.num_open = self.peak_open = 0
        self.prompt_total = self.cached_total = 0
        self.records: list[dict[str, Any]] = []  # body, received, done (perf_counter)


def answer(n: int, tokens_per_chunk: int = 1) -> str:
    return "".join(f"w{i} " for i in range(math.ceil(n / tokens_per_chunk)))


def make_app(fake: Fake) -> Any:
    app = FastAPI()

    def sse(data: Any) -> str:
        return f"data: {json.dumps(data)}\n\n"

    def chunk(kind: str, piece: str, text: str, n: int | None) -> dict[str, Any]:
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n,
                 "prompt_tokens_details": {"cached_tokens": USAGE_CACHED}}  # fmt: skip
        if kind == "generate":
            meta = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n or 0,
                    "cached_tokens": USAGE_CACHED}  # fmt: skip
            return {"text": text, "meta_info": meta if fake.send_usage else {}}
        if n is not None:
            return {"choices": [], "usage": usage}
        if kind == "chat":
            return {"choices": [{"index": 0, "delta": {"content": piece}}]}
        return {"choices": [{"index": 0, "text": piece}]}

    async def events(kind: str, n: int, record: dict[str, Any]):
        open_now = True
        try:
            deadline = time.perf_counter() + 2.0
            while fake.peak_open < fake.hold and time.perf_counter() < deadline:
                await asyncio.sleep(0.005)
            if kind == "chat":
                yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})  # fmt: skip
            text = ""
            for i in range(math.ceil(n / fake.tokens_per_chunk)):
                await asyncio.sleep(0.001)
                piece = f"w{i} "
                text += piece
                yield sse(chunk(kind, piece, text, None))
            if fake.send_usage and kind != "generate":
                yield sse(chunk(kind, "", text, n))
            elif kind == "generate":
                yield sse(chunk(kind, "", text, n))  # the final chunk: no new text
            record["done"] = time.perf_counter()
            fake.num_open -= 1  # before [DONE]: the client may start the next one right after
            open_now = False
            yield "data: [DONE]\n\n"
        finally:
            if open_now:
                fake.num_open -= 1

    async def handle(request: Request, kind: str) -> Any:
        body = await request.json()
        fake.num_requests += 1
        if fake.fail_every and fake.num_requests % fake.fail_every == 0:
            return JSONResponse({"error": {"message": "refused", "code": 400}}, status_code=400)
        n = body["sampling_params"]["max_new_tokens"] if kind == "generate" else body["max_tokens"]
        record = {"body": body, "received": time.perf_counter(), "done": None}
        fake.records.append(record)
        fake.num_open += 1
        fake.peak_open = max(fake.peak_open, fake.num_open)
        fake.prompt_total += PROMPT_TOKENS
        fake.cached_total += SERVER_CACHED
        return StreamingResponse(events(kind, n, record), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models() -> Any:
        return {"data": [{"id": "fake-model"}]}

    @app.get("/get_model_info")
    async def model_info() -> Any:
        return {"model_path": str(fake.tok_dir)}

    @app.get("/get_server_info")
    async def server_info() -> Any:
        return {"num_cached_tokens_total": fake.cached_total,
                "num_prompt_tokens_total": fake.prompt_total}  # fmt: skip

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(vllm_metrics(fake.cached_total, fake.prompt_total))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await handle(request, "chat")

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        return await handle(request, "generate")

    return app


def vllm_metrics(hits: float, queries: float) -> str:
    """vLLM-style counters split over two engines; engine 1's never move."""
    return "\n".join([
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of tokens.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="fake"}} {float(hits)}',
        'vllm:prefix_cache_hits_total{engine="1",model_name="fake"} 7.0',
        'vllm:prefix_cache_hits_created{engine="0",model_name="fake"} 1.7e+09',
        f'vllm:prefix_cache_queries_total{{engine="0",model_name="fake"}} {float(queries)}',
        'vllm:prefix_cache_queries_total{engine="1",model_name="fake"} 100.0',
    ]) + "\n"  # fmt: skip


@contextmanager
def serve(app: Any):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from fixtures.tiny_models import build_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def served(tok_dir):
    fake = Fake(tok_dir)
    with serve(make_app(fake)) as url:
        yield fake, url


@pytest.fixture
def fake(served):
    served[0].reset()
    return served[0]


@pytest.fixture
def url(served):
    return served[1]


def flags(url: str, *extra: str) -> list[str]:
    return ["--base-url", url, "--disable-tqdm", "--random-input-len", "16",
            "--random-output-len", "4", "--random-range-ratio", "1", *extra]  # fmt: skip


def run(argv: list[str]) -> tuple[dict[str, Any], list[RequestResult]]:
    return asyncio.run(bs.benchmark(bs.parse_args(argv)))


# ---------------------------------------------------------------------- pure functions
def test_percentiles_interpolate_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    assert percentile([0.0, 100.0], 99) == pytest.approx(99.0)
    assert percentile([7.0], 99) == 7.0
    assert summarize([1.0, 2.0, 3.0, 4.0]) == {
        "mean": 2.5, "p50": 2.5, "p90": pytest.approx(3.7), "p99": pytest.approx(3.97), "max": 4.0,
    }  # fmt: skip
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}


def test_best_hit_rate_counts_each_group_prefix_once():
    convs = [
        Conversation(["q"], [10], 4, "s0", 90, 0),
        Conversation(["q"], [10], 4, "s0", 90, 0),
        Conversation(["q"], [10], 4, "s0", 90, 0),
        Conversation(["q"], [10], 4, "s1", 50, 1),
    ]
    assert best_prefix_hit_rate(convs) == pytest.approx(2 * 90 / (300 + 60))
    assert best_prefix_hit_rate([Conversation(["q"], [10], 4)]) is None


def test_gsp_dataset_is_ordered_group_by_group_unless_shuffled(tok_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    gsp = ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "3",
           "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "40",
           "--gsp-question-len", "8", "--gsp-output-len", "2"]  # fmt: skip
    args = bs.parse_args(gsp)
    convs = gsp_dataset(args, TextMaker(tokenizer, random.Random(0)))
    assert [c.group_idx for c in convs] == [0] * 4 + [1] * 4 + [2] * 4
    for g in range(3):
        members = convs[4 * g : 4 * g + 4]
        assert len({c.system for c in members}) == 1
        assert members[0].system_len == count_tokens(tokenizer, members[0].system) == 40
        assert all(c.turn_lens == [8] for c in members)
    shared = sum(3 * convs[4 * g].system_len for g in range(3))
    total = sum(c.system_len + c.turn_lens[0] for c in convs)
    assert best_prefix_hit_rate(convs) == pytest.approx(shared / total)

    args = bs.parse_args([*gsp, "--gsp-shuffle"])
    mixed = gsp_dataset(args, TextMaker(tokenizer, random.Random(0)))
    assert sorted(c.group_idx for c in mixed) == [c.group_idx for c in convs]
    assert [c.group_idx for c in mixed] != [c.group_idx for c in convs]
    assert best_prefix_hit_rate(mixed) == pytest.approx(shared / total)


def test_prometheus_counters_sum_over_label_sets():
    text = vllm_metrics(30, 50)
    assert prometheus_sum(text, "vllm:prefix_cache_hits_total") == 37.0
    assert prometheus_sum(text, "vllm:prefix_cache_queries_total") == 150.0
    assert prometheus_sum(text, "vllm:num_requests_running") is None


def test_measured_hit_rate_prefers_server_deltas_then_usage():
    r = RequestResult(0, 0, prompt_len=10, cached_tokens=5)
    assert measured_hit_rate((10, 100), (40, 200), [r]) == (0.3, "server counters")
    assert measured_hit_rate(None, None, [r, r]) == (0.5, "usage cached_tokens")
    assert measured_hit_rate(None, None, [RequestResult(0, 0, prompt_len=10)]) == (
        None,
        "n/a",
    )


def test_bad_flags_are_refused_with_a_message(capsys):
    with pytest.raises(SystemExit):
        bs.parse_args(["--backend", "vllm", "--api", "generate"])
    assert "SGLang's native route" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bs.parse_args(["--extra-request-body", "[1]"])


# ---------------------------------------------------------------------- against the fake
@pytest.mark.parametrize("api", ["completions", "chat", "generate"])
def test_per_request_metrics_follow_the_stream(fake, url, api):
    fake.reset(tokens_per_chunk=2)
    report, results = run(flags(url, "--api", api, "--num-prompts", "3", "--random-output-len", "6"))  # fmt: skip
    assert report["completed"] == 3 and report["failed"] == 0
    for r in results:
        assert r.ok, r.error
        assert r.text == answer(6, 2)
        assert r.output_len == 6  # from usage / meta_info, not the tokenizer
        assert r.prompt_len == PROMPT_TOKENS
        assert len(r.chunk_times) == 3 and len(r.itls) == 2  # the chat role chunk is no text
        assert r.start < r.chunk_times[0] <= r.chunk_times[1] <= r.chunk_times[2] <= r.end
        assert 0 < r.ttft <= r.e2e
        assert r.tpot == pytest.approx((r.e2e - r.ttft) / 5)
    assert len(report["details"]["itl_ms"]) == 6
    assert report["details"]["output_lens"] == [6, 6, 6]
    assert report["total_output_tokens"] == 18 and report["total_input_tokens"] == 30
    body = fake.records[-1]["body"]
    if api == "generate":
        assert body["sampling_params"] == {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    else:
        assert body["max_tokens"] == 6 and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True} and body["model"] == "fake-model"


def test_without_usage_the_tokenizer_counts(fake, url, tok_dir):
    from transformers import AutoTokenizer

    fake.reset(send_usage=False)
    report, results = run(flags(url, "--num-prompts", "2", "--disable-ignore-eos"))
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    for r in results:
        assert r.output_len == count_tokens(tokenizer, answer(4))
        assert r.prompt_len > 0  # the dataset's count
    assert "ignore_eos" not in fake.records[-1]["body"]
    assert report["cache_hit_rate"] == pytest.approx(0.4)  # sglite counters still answer


def test_failed_requests_are_counted_and_reported(fake, url):
    fake.reset(fail_every=3)
    report, results = run(flags(url, "--num-prompts", "6", "--warmup-requests", "0"))
    assert report["completed"] == 4 and report["failed"] == 2
    assert [r.ok for r in results].count(False) == 2
    assert all(r.error.startswith("HTTP 400") for r in results if not r.ok)
    assert report["errors"][0].startswith("2 x HTTP 400") and "refused" in report["errors"][0]
    assert len(report["details"]["ttft_ms"]) == 4
    block = format_report(report)
    assert "Failed requests:" in block and "HTTP 400" in block


def test_warm_up_failure_stops_the_run(fake, url):
    fake.reset(fail_every=1)
    with pytest.raises(SystemExit, match="warm-up request failed: HTTP 400"):
        run(flags(url, "--num-prompts", "2"))


def test_max_concurrency_is_respected(fake, url):
    fake.reset(hold=2)
    report, _ = run(
        flags(url, "--num-prompts", "8", "--max-concurrency", "2", "--warmup-requests", "0")
    )
    assert fake.peak_open == 2
    assert report["concurrency_peak"] == 2 and report["completed"] == 8


def test_request_rate_spreads_arrivals(fake, url):
    report, results = run(flags(url, "--num-prompts", "4", "--request-rate", "200"))
    starts = sorted(r.start for r in results)
    assert report["completed"] == 4 and starts == [r.start for r in results]
    assert report["request_rate"] == 200.0


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_multi_turn_sends_each_turn_after_the_previous_answer(fake, url, api):
    argv = flags(url, "--api", api, "--dataset-name", "multi-turn", "--warmup-requests", "0",
                 "--multi-turn-num-conversations", "2", "--multi-turn-turns", "3",
                 "--multi-turn-input-len", "8", "--multi-turn-output-len", "4")  # fmt: skip
    report, results = run(argv)
    assert report["completed"] == 6
    key = "messages" if api == "chat" else "prompt"
    firsts = sorted((rec["body"][key] for rec in fake.records), key=len)[:2]  # turn 0s
    by_conv: dict[int, list[dict[str, Any]]] = {}
    for rec in fake.records:
        conv = [i for i, f in enumerate(firsts) if rec["body"][key][: len(f)] == f]
        assert len(conv) == 1
        by_conv.setdefault(conv[0], []).append(rec)
    assert sorted(len(v) for v in by_conv.values()) == [3, 3]
    for recs in by_conv.values():
        for k, (prev, cur) in enumerate(zip(recs, recs[1:]), 1):
            assert cur["received"] >= prev["done"]
            if api == "chat":
                msgs = cur["body"]["messages"]
                assert [m["role"] for m in msgs] == ["user", "assistant"] * k + ["user"]
                assert msgs[:-1] == prev["body"]["messages"] + [
                    {"role": "assistant", "content": answer(4)}
                ]
            else:
                assert cur["body"]["prompt"].startswith(prev["body"]["prompt"] + answer(4))
    assert sorted((r.conv_idx, r.turn_idx) for r in results) == [
        (c, t) for c in range(2) for t in range(3)
    ]


def test_multi_turn_stops_a_conversation_at_its_first_failure(fake, url):
    fake.reset(fail_every=2)
    argv = flags(url, "--dataset-name", "multi-turn", "--warmup-requests", "0",
                 "--multi-turn-num-conversations", "1", "--multi-turn-turns", "3")  # fmt: skip
    report, results = run(argv)
    assert [r.ok for r in results] == [True, False, False]
    assert results[2].error.startswith("not sent")
    assert report["failed"] == 2 and fake.num_requests == 2


@pytest.mark.parametrize(
    "backend, rate, source",
    [("sglite", 0.4, "server counters"), ("vllm", 0.4, "server counters"),
     ("openai", 0.2, "usage cached_tokens")],
)  # fmt: skip
def test_cache_hit_rate_from_server_counters_or_usage(fake, url, backend, rate, source):
    gsp = ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2",
           "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "24",
           "--gsp-question-len", "4", "--gsp-output-len", "2", "--warmup-requests", "2"]  # fmt: skip
    report, _ = run(flags(url, "--backend", backend, *gsp))
    assert report["cache_hit_rate"] == pytest.approx(rate)  # the warm-up is left out
    assert report["cache_hit_source"] == source
    assert 0.0 < report["best_cache_hit_rate"] < 1.0
    assert report["details"]["group_idx"] == [0, 0, 0, 1, 1, 1]
    assert "Best possible hit rate" in format_report(report)


def load_report_module():
    spec = importlib.util.spec_from_file_location("bench_report", REPO / "benches" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def results_file(fake, url, tmp_path):
    path = tmp_path / "runs.jsonl"
    for backend in ("sglite", "vllm"):
        argv = flags(url, "--backend", backend, "--num-prompts", "4", "--max-concurrency", "2",
                     "--output-file", str(path), "--tag", f"{backend}-c2")  # fmt: skip
        bs.main(argv)
    return path


def test_json_lines_feed_the_report_table(results_file, tmp_path, capsys):
    runs = [json.loads(line) for line in results_file.read_text().splitlines()]
    assert [r["backend"] for r in runs] == ["sglite", "vllm"]
    assert runs[0]["args"]["num_prompts"] == 4 and "api_key" not in runs[0]["args"]
    assert len(runs[0]["details"]["ttft_ms"]) == 4
    capsys.readouterr()

    report = load_report_module()
    assert report.main([str(results_file), "--out-dir", str(tmp_path / "out"), "--no-plots"]) == 0
    table = (tmp_path / "out" / "report.md").read_text()
    assert table.strip() == capsys.readouterr().out.strip()
    lines = table.strip().splitlines()
    assert len(lines) == 4  # header, rule, two runs
    sglite_row, vllm_row = (line.split("|")[1:-1] for line in lines[2:])
    assert sglite_row[0].strip() == "sglite-c2" and sglite_row[3].strip() == "2"
    ratio = runs[0]["output_throughput"] / runs[1]["output_throughput"]
    assert sglite_row[-1].strip() == f"{ratio:.2f}x vs vllm"
    assert vllm_row[-1].strip() == ""
    assert sglite_row[-2].strip() == f"{runs[0]['cache_hit_rate']:.1%}"


def test_report_plots(results_file, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots"
    assert load_report_module().main([str(results_file), "--out-dir", str(out)]) == 0
    for name in ("report.md", "throughput.png", "ttft_cdf.png", "itl_cdf.png"):
        assert (out / name).stat().st_size > 0
