"""Operating the server like SGLang, on a real server process with the model-free fake
scheduler (tests/fixtures/serving.py), started from a Hub repo id in an offline local cache
with the ops flags: --api-key, --enable-metrics, --log-requests, --enable-cache-report,
--max-queued-requests. Auth, CORS, SGLang's metric names and counts, request log lines,
the waiting-queue limit, /tokenize, /detokenize, /v1/models/{id}, /get_server_info."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from fixtures.hub_cache import add_to_hub_cache
from fixtures.serving import build_tiny_tokenizer, start_server

REPO_ID = "sglite-test/tiny-fake"
KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    src = build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    (src / "config.json").write_text("{}")  # the fake scheduler reads neither
    (src / "model.safetensors").write_bytes(b"")
    hf_home = tmp_path_factory.mktemp("hf_home")
    add_to_hub_cache(hf_home, REPO_ID, src)
    log = tmp_path_factory.mktemp("log") / "server.log"
    srv = start_server(
        [
            "--model-path", REPO_ID, "--context-length", "4096",
            "--api-key", KEY, "--enable-metrics", "--log-requests", "--log-requests-level", "2",
            "--enable-cache-report", "--max-queued-requests", "1",
        ],
        log,
        fake=True,
        timeout=120,
        env={"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as c:
        yield c


def _generate(client, text: str, n: int = 3, **kw) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}, **kw}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------- auth, CORS, routes
def test_api_key_is_required_except_on_probes(server):
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        for method, path in [("POST", "/generate"), ("GET", "/v1/models"), ("GET", "/nope")]:
            r = anon.request(method, path, json={"text": "Hi"})
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == 401 and "Bearer" in r.json()["error"]["message"]
            assert r.headers["www-authenticate"] == "Bearer"
        r = anon.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "invalid API key" in r.json()["error"]["message"]
        r = anon.get("/v1/models", headers={"Authorization": KEY})  # no scheme
        assert r.status_code == 401
        assert anon.get("/health").status_code == 200
        assert anon.get("/metrics").status_code == 200


def test_with_the_key_unknown_routes_are_json_404(client):
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_cors_allows_any_origin_by_default(server):
    origin = {"Origin": "https://app.example"}
    preflight = httpx.options(
        server.url + "/v1/chat/completions",
        headers={
            **origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert preflight.status_code == 200  # answered before auth: browsers send no key here
    assert preflight.headers["access-control-allow-origin"] in ("*", "https://app.example")
    r = httpx.get(server.url + "/v1/models", headers={**origin, **AUTH})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_models_list_the_repo_id_as_given(client):
    models = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [REPO_ID]
    assert models[0]["root"] == REPO_ID  # as given, not the local snapshot folder
    assert client.get(f"/v1/models/{REPO_ID}").json()["id"] == REPO_ID
    r = client.get("/v1/models/other/model")
    assert r.status_code == 404 and "other/model" in r.json()["error"]["message"]


def test_server_info_is_flat_like_sglang(client):
    info = client.get("/get_server_info").json()
    assert info["served_model_name"] == REPO_ID and info["api_key"] == "***"
    assert info["max_total_num_tokens"] > 0 and info["context_length"] == 4096
    assert info["enable_metrics"] is True and "version" in info
    assert info["num_running_reqs"] == 0 and "cache_hit_rate" in info
    assert info["internal_states"][0]["kv_total_tokens"] > 0


def test_tokenize_and_detokenize(client):
    r = client.post("/tokenize", json={"model": "x", "prompt": "Hello world"})
    out = r.json()
    assert r.status_code == 200 and out["count"] == len(out["tokens"]) > 0
    assert out["max_model_len"] == 4096
    text = client.post("/detokenize", json={"tokens": out["tokens"]}).json()["text"]
    assert text == "Hello world"
    batch = client.post("/v1/tokenize", json={"prompt": ["Hello", "東京"]}).json()
    assert batch["count"] == [len(t) for t in batch["tokens"]]
    texts = client.post("/v1/detokenize", json={"tokens": batch["tokens"]}).json()["text"]
    assert texts == ["Hello", "東京"]
    r = client.post("/detokenize", json={"tokens": [1, 10**6]})
    assert r.status_code == 400 and "tokens[1]" in r.json()["error"]["message"]


# ---------------------------------------------------------------------- usage and metrics
def test_cache_report_in_usage(client):
    body = {"model": "default", "prompt": "Hello", "max_tokens": 2}
    usage = client.post("/v1/completions", json=body).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(sglang:[a-z0-9_]+)\{([^}]*)\} (\S+)$", line)
        if m and "le=" not in m.group(2):
            assert m.group(2) == f'model_name="{REPO_ID}"', line
            out[m.group(1)] = float(m.group(3))
    return out


def test_metrics_have_sglang_names_and_count_every_request(client):
    """One non-streamed and one streamed request, 3 tokens each: both get a TTFT and an
    end-to-end latency, each of their later 2 tokens an inter-token latency."""
    before = _samples(client.get("/metrics").text)
    _generate(client, "Hello world")
    with client.stream(
        "POST", "/generate", json={"text": "Hi there", "stream": True,
                                   "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
    ) as r:  # fmt: skip
        assert r.status_code == 200 and list(r.iter_lines())[-2] == "data: [DONE]"
    text = client.get("/metrics").text
    after = _samples(text)
    assert "_created" not in text  # SGLang exports no `*_created` series
    for name in (
        "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_used_tokens",
        "sglang:token_usage", "sglang:cache_hit_rate", "sglang:gen_throughput",
    ):  # fmt: skip
        assert name in after, name

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("sglang:num_requests_total") == 2
    assert delta("sglang:generation_tokens_total") == 6
    assert delta("sglang:prompt_tokens_total") > 0
    assert delta("sglang:time_to_first_token_seconds_count") == 2
    assert delta("sglang:e2e_request_latency_seconds_count") == 2
    assert delta("sglang:inter_token_latency_seconds_count") == 4
    assert after["sglang:gen_throughput"] > 0


def test_a_log_line_per_request(client, server):
    out = _generate(client, "Hello log", n=4, rid="log-me")
    assert out["meta_info"]["completion_tokens"] == 4
    lines = [x for x in server.log().splitlines() if "rid=log-me " in x]
    assert len(lines) == 1, server.log()[-2000:]
    line = lines[0]
    for part in (
        f"prompt_tokens={out['meta_info']['prompt_tokens']}", "output_tokens=4",
        "cached_tokens=0", 'finish={"type":"length","length":4}',
        '"max_new_tokens":4', 'prompt="Hello log"', f"output={json.dumps(out['text'])}",
    ):  # fmt: skip
        assert part in line, line
    assert re.search(r" ttft=\d+\.\d{3}s latency=\d+\.\d{3}s ", line), line


# ---------------------------------------------------------------------- queue limit
def test_waiting_queue_limit_answers_503_with_retry_after(client):
    """--max-queued-requests 1: with one request waiting (the fake holds "__hold__" in its
    queue), the next is refused; a batch submitted while none waits is accepted whole."""
    hold = {"text": "__hold__", "rid": "held", "stream": True}
    with client.stream("POST", "/generate", json=hold) as held:
        assert held.status_code == 200  # headers are sent after the request was submitted
        r = client.post("/generate", json={"text": "Hi"})
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert "--max-queued-requests 1" in r.json()["error"]["message"]
        assert client.post("/abort_request", json={"rid": "held"}).status_code == 200
    out = client.post(
        "/generate", json={"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 2}}
    )
    assert out.status_code == 200 and len(out.json()) == 3


# ---------------------------------------------------------------------- in-process units
def _app(**args):
    from types import SimpleNamespace

    from sglite.config import ServerArgs
    from sglite.server.http_server import create_app
    from sglite.server.tokenizer_manager import TokenizerManager

    server_args = ServerArgs(model_path="m", **args)
    info = {"context_length": 64, "vocab_size": 10}
    return create_app(TokenizerManager(server_args, info, SimpleNamespace(), None))


def test_cors_can_be_restricted():
    from fastapi.testclient import TestClient

    client = TestClient(_app(allowed_origins="https://ok.example"))
    ok = client.get("/v1/models", headers={"Origin": "https://ok.example"})
    assert ok.headers["access-control-allow-origin"] == "https://ok.example"
    bad = client.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert bad.status_code == 403 and "access-control-allow-origin" not in bad.headers
    preflight = client.options(
        "/generate",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 400


def test_request_log_levels():
    from types import SimpleNamespace

    from sglite.sampling_params import SamplingParams
    from sglite.server.request_log import TEXT_EDGE, RequestLog, create_request_log

    req = SimpleNamespace(
        rid="r1", prompt_len=7, completion_tokens=3, cached_tokens=2, text="out\n" * 80,
        created=10.0, first_output=10.25, finished_reason={"type": "stop", "matched": 2},
        prompt_text="secret prompt", sampling_params=SamplingParams(temperature=0.0, max_new_tokens=3),
    )  # fmt: skip
    line0 = RequestLog(0).line(req, now=11.5)
    assert line0 == (
        "request rid=r1 prompt_tokens=7 output_tokens=3 cached_tokens=2 ttft=0.250s "
        'latency=1.500s finish={"type":"stop","matched":2}'
    )
    line1 = RequestLog(1).line(req, now=11.5)
    assert '"temperature":0.0' in line1 and '"max_new_tokens":3' in line1
    assert '"top_p"' not in line1 and "secret" not in line1  # defaults and text left out
    line2 = RequestLog(2).line(req, now=11.5)
    assert 'prompt="secret prompt"' in line2 and "characters)..." in line2
    assert len(line2) < len(line1) + 4 * TEXT_EDGE + 100
    line3 = RequestLog(3).line(req, now=11.5)
    assert json.dumps(req.text) in line3 and "\n" not in line3
    create_request_log(False, 3).on_finish(req, now=11.5)  # the null log: no error, no line
