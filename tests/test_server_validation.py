"""Input validation and the HTTP surface, on a real server process with the model-free fake
scheduler (tests/fixtures/serving.py): every bad input gets a 400 whose message names the
field, the server keeps serving, and the routes answer in the documented shapes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import httpx
import pytest

from fixtures.serving import build_tiny_tokenizer, start_server
from sglite.server.inputs import Prompt

CTX = 4096
LONG_TEXT = "Hello world! " * 1500  # > CTX tokens with the tiny tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def server(tok_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    srv = start_server(
        ["--model-path", str(tok_dir), "--context-length", str(CTX), "--served-model-name", "tiny"],
        log,
        fake=True,
        timeout=120,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _chat(**kw):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    body.update(kw)
    return body


def _cmpl(**kw):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4}
    body.update(kw)
    return body


BAD = [
    # (route, body (str = raw), words the message must contain)
    ("/generate", "{bad json", ["malformed JSON"]),
    ("/generate", "", ["empty"]),
    ("/generate", "[1, 2]", ["JSON object"]),
    ("/generate", {"text": 5}, ["text"]),
    ("/generate", {"text": "Hi", "stream": "yes"}, ["stream"]),
    ("/generate", {"text": "Hi", "sampling_params": "hot"}, ["sampling_params"]),
    ("/generate", {"text": "Hi", "input_ids": [1]}, ["text", "input_ids"]),
    ("/generate", {}, ["text", "input_ids"]),
    ("/generate", {"text": ""}, ["text", "empty"]),
    ("/generate", {"text": []}, ["text", "empty"]),
    ("/generate", {"input_ids": []}, ["input_ids"]),
    ("/generate", {"input_ids": [1, 2, 99999]}, ["input_ids[2]", "99999"]),
    ("/generate", {"input_ids": [[1], [2, -1]]}, ["input_ids[1]"]),
    ("/generate", {"text": LONG_TEXT}, ["text", "context length", str(CTX)]),
    (
        "/generate",
        {"text": "Hi", "sampling_params": {"max_new_tokens": CTX}},
        ["max_new_tokens", "context length"],
    ),
    ("/generate", {"text": "Hi", "sampling_params": {"top_p": 5}}, ["top_p"]),
    ("/generate", {"text": "Hi", "sampling_params": {"temperature": -1}}, ["temperature"]),
    ("/generate", {"text": "Hi", "sampling_params": {"temperature": "hot"}}, ["temperature"]),
    ("/generate", {"text": "Hi", "sampling_params": {"top_k": 0}}, ["top_k"]),
    (
        "/generate",
        {"text": "Hi", "sampling_params": {"frequency_penalty": 9}},
        ["frequency_penalty"],
    ),
    ("/generate", {"text": "Hi", "sampling_params": {"tmperature": 0.5}}, ["tmperature"]),
    (
        "/generate",
        {"text": "Hi", "sampling_params": {"stop_token_ids": [10**6]}},
        ["stop_token_ids"],
    ),
    ("/generate", {"text": "Hi", "sampling_params": {"n": 0}}, ["n "]),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, ["sampling_params"]),
    (
        "/generate",
        {"text": "Hi", "sampling_params": {"max_new_tokens": CTX - 2}},
        ["max_new_tokens", "KV cache"],
    ),
    ("/generate", {"text": ["a", "b"], "rid": ["x", "x"]}, ["rid"]),
    ("/generate", {"text": "Hi", "return_logprob": "yes"}, ["return_logprob"]),
    ("/generate", {"text": "Hi", "return_logprob": True, "top_logprobs_num": -1}, ["top_logprobs"]),
    ("/v1/completions", "{", ["malformed JSON"]),
    ("/v1/completions", _cmpl(max_tokens=CTX), ["max_tokens", "context length"]),
    ("/v1/completions", _cmpl(prompt=LONG_TEXT), ["prompt", "context length"]),
    ("/v1/completions", _cmpl(prompt=""), ["prompt", "empty"]),
    ("/v1/completions", _cmpl(prompt=[]), ["prompt"]),
    ("/v1/completions", _cmpl(temperature="hot"), ["temperature"]),
    ("/v1/completions", _cmpl(top_p=0), ["top_p"]),
    ("/v1/completions", _cmpl(n=0), ["n "]),
    ("/v1/completions", _cmpl(logprobs=99), ["logprobs"]),
    ("/v1/completions", {"prompt": "Hi"}, ["model"]),
    ("/v1/chat/completions", _chat(messages=[]), ["messages"]),
    (
        "/v1/chat/completions",
        _chat(messages=[{"role": "wizard", "content": "x"}]),
        ["messages[0].role"],
    ),
    ("/v1/chat/completions", _chat(messages="Hi"), ["messages"]),
    (
        "/v1/chat/completions",
        _chat(max_completion_tokens=CTX),
        ["max_completion_tokens", "context length"],
    ),
    ("/v1/chat/completions", _chat(presence_penalty=3), ["presence_penalty"]),
    ("/v1/chat/completions", _chat(stream_options={"include_usage": True}), ["stream_options"]),
    ("/abort_request", {}, ["rid"]),
]


@pytest.mark.parametrize("route,body,words", BAD, ids=[f"{r}:{str(b)[:40]}" for r, b, _ in BAD])
def test_bad_input_is_400_naming_the_field(client, route, body, words):
    content = body if isinstance(body, str) else json.dumps(body)
    r = client.post(route, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    for w in words:
        assert w in message, message


def test_server_keeps_serving_after_bad_inputs(client):
    r = client.post(
        "/generate",
        json={"text": "Hello world", "sampling_params": {"max_new_tokens": 5, "temperature": 0}},
    )
    assert r.status_code == 200
    out = r.json()
    assert out["text"] == "Hello world"[: len(out["text"])] and out["text"]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 5
    assert meta["prompt_tokens"] > 0 and meta["e2e_latency"] > 0 and "cached_tokens" in meta


def test_batch_and_n(client):
    r = client.post(
        "/generate",
        json={"text": ["Hello", "東京"], "sampling_params": {"max_new_tokens": 3, "n": 2}},
    )
    outs = r.json()
    assert r.status_code == 200 and len(outs) == 4
    assert [o["text"][:1] for o in outs] == ["H", "H", "東", "東"]
    ids = r.json()[0]["meta_info"]["id"]
    assert ids.endswith("_0")


def test_generate_stream_is_sse_ending_with_done(client):
    events = []
    with client.stream(
        "POST",
        "/generate",
        json={"text": "Emoji 😀 東京", "stream": True, "sampling_params": {"max_new_tokens": 8}},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: ")
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert "\ufffd" not in texts[-1]


def test_info_routes(client):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    info = client.get("/get_model_info").json()
    assert info["context_length"] == CTX and info["served_model_name"] == "tiny"
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny"
    server_info = client.get("/get_server_info").json()
    assert server_info["context_length"] == CTX  # SGLang's flat shape
    assert server_info["tree_core"]["reason"] == "fake scheduler"
    assert server_info["kv_total_tokens"] > 0
    assert client.post("/flush_cache").status_code == 200


def test_any_model_name_is_accepted(client):
    """As SGLang: clients send "default", a Hub id or anything; the answer names the model."""
    for model in ("gpt-4", "default", "org/some-model"):
        r = client.post("/v1/completions", json=_cmpl(model=model))
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "tiny"
        r = client.post("/v1/chat/completions", json=_chat(model=model))
        assert r.status_code == 200, r.text


def test_defaults_off_metrics_cache_report(client):
    """Without --enable-metrics /metrics is a 404 (JSON envelope); without
    --enable-cache-report usage has no prompt_tokens_details, streamed or not."""
    r = client.get("/metrics")
    assert r.status_code == 404 and "--enable-metrics" in r.json()["error"]["message"]
    usage = client.post("/v1/completions", json=_cmpl()).json()["usage"]
    assert usage["prompt_tokens"] > 0 and "prompt_tokens_details" not in usage
    body = _chat(stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] > 0
    assert "prompt_tokens_details" not in chunks[-1]["usage"]


def test_unknown_route_is_a_json_404(client):
    r = client.get("/no/such/route")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == 404 and "/no/such/route" in r.json()["error"]["message"]
    r = client.get("/generate")  # exists, but only for POST
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def _running(client) -> int:
    return client.get("/get_server_info").json()["num_running_reqs"]


def _wait_idle(client, timeout=10.0) -> None:
    deadline = time.monotonic() + timeout
    while _running(client) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(client) == 0


def test_client_disconnect_aborts_the_request(client, server):
    body = {"text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": 3000}}
    with httpx.Client(base_url=server.url, timeout=30) as other:
        with other.stream("POST", "/generate", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            assert _running(client) == 1
    _wait_idle(client)


def test_non_streaming_disconnect_aborts_the_request(client, server):
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 3000}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json=body, timeout=0.5)
    _wait_idle(client, timeout=15)


def test_abort_request_by_rid(client, server):
    body = {"text": "Hello", "rid": "to-abort", "sampling_params": {"max_new_tokens": 3000}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, server.url + "/generate", json=body, timeout=30)
        deadline = time.monotonic() + 10
        while _running(client) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.post("/abort_request", json={"rid": "to-abort"}).status_code == 200
        out = fut.result().json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    _wait_idle(client)


def test_concurrent_streams_are_independent(server):
    prompts = [f"Hello {i} world" for i in range(16)]

    async def one(c: httpx.AsyncClient, text: str) -> str:
        body = {"text": text, "stream": True, "sampling_params": {"max_new_tokens": 20}}
        last = None
        async with c.stream("POST", "/generate", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    last = json.loads(line[6:])
        return last["text"]

    async def main() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    for p, text in zip(prompts, asyncio.run(main())):
        assert text == (p * 10)[: len(text)] and len(text) >= len(p)  # the fake echoes


def _manager(**kw):
    from sglite.server.tokenizer_manager import TokenizerManager

    class Args:
        served_model_name = "m"
        model_path = "m"
        page_size = 1

    return TokenizerManager(Args(), {"context_length": 16, "vocab_size": 10}, None, None, **kw)


def test_queue_limit_counts_waiting_requests_only():
    """--max-queued-requests counts requests without an output token yet; running ones
    (they have output) do not count, and a batch is not refused for its own size."""
    from types import SimpleNamespace

    from sglite.server.errors import QueueFullError

    tm = _manager(max_queued_requests=2)
    tm._send = tm._send_to = lambda *a: None  # no scheduler: sending always succeeds
    tm.states["running"] = SimpleNamespace(first_output=1.0)
    tm.states["waiting"] = SimpleNamespace(first_output=None)
    batch = [Prompt(f"b{i}", [1], None) for i in range(5)]
    asyncio.run(tm.submit(batch, stream=False))  # 1 waiting < 2: the whole batch goes in
    assert tm.num_waiting == 6
    with pytest.raises(QueueFullError) as e:
        asyncio.run(tm.submit([Prompt("r", [1], None)], stream=False))
    assert e.value.status_code == 503 and e.value.retry_after_s >= 1
    assert "--max-queued-requests 2" in e.value.message


def test_no_queue_limit_by_default():
    from types import SimpleNamespace

    tm = _manager()
    tm._send = tm._send_to = lambda *a: None
    for i in range(3000):
        tm.states[f"w{i}"] = SimpleNamespace(first_output=None)
    asyncio.run(tm.submit([Prompt("r", [1], None)], stream=False))
    assert "r" in tm.states
