"""The front door on a network (issue 23, items 1, 2, 4, 5, 7, 8), on a real server process
with the model-free fake scheduler (tests/fixtures/serving.py) and small limits.

- CPU work is off the event loop: while a chat request's template is still rendering (a
  template that spins, then renders "__hold__", which the fake scheduler holds), /health
  and /get_server_info answer, and the scheduler has not seen the request yet;
- every limit refuses with a short 400 (413 for the body) naming its flag, and nothing
  reaches the scheduler;
- bad bytes and numbers (lone surrogates, huge integers, deep nesting) are 400s, also for
  a streamed request and for rid, before any work is queued;
- JSON routes want application/json (415), /flush_cache is POST-only, a request from an
  Origin not in --allowed-origins is refused (403) before it takes effect;
- /v1/completions with `max_tokens: null` gets OpenAI's default of 16 tokens;
- the info routes never show the local folder a Hub id was resolved to.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest

from fixtures.hub_cache import add_to_hub_cache
from fixtures.serving import CHAT_TEMPLATE, build_tiny_tokenizer, start_server

ORIGIN = "http://ok.example"
# renders ChatML, or (with chat_template_kwargs {"spin": N}) spins N x 100,000 jinja
# iterations first and renders "__hold__", which the fake scheduler holds until aborted
SPIN_TEMPLATE = (
    "{% if spin is defined %}{% for i in range(spin) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}__hold__{% else %}" + CHAT_TEMPLATE + "{% endif %}"
)
LIMITS = {
    "--max-request-bytes": 262144,
    "--max-prompts-per-request": 8,
    "--max-sequences-per-request": 16,
    "--max-prompt-chars": 5000,
    "--max-chat-messages": 8,
    "--max-top-logprobs-num": 5,
    "--max-logit-bias": 4,
    "--max-grammar-chars": 200,
    "--max-json-depth": 16,
}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def server(tok_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "spin.jinja"
    template.write_text(SPIN_TEMPLATE)
    args = ["--model-path", str(tok_dir), "--context-length", "4096", "--chat-template"]
    args += [str(template), "--allowed-origins", ORIGIN]
    for flag, value in LIMITS.items():
        args += [flag, str(value)]
    srv = start_server(args, tmp_path_factory.mktemp("log") / "server.log", fake=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _stats(client) -> dict:
    return client.get("/get_server_info").json()


def _wait_waiting(client, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _stats(client)["num_waiting_reqs"] != count:
        assert time.monotonic() < deadline, f"never {count} waiting requests"
        time.sleep(0.05)


def _chat(content="Hi", **kw):
    return {"model": "m", "messages": [{"role": "user", "content": content}], **kw}


# ---------------------------------------------------------------------- item 1
def test_loop_answers_while_a_template_renders(server, client):
    """The spinning template takes seconds in a tokenizer thread; meanwhile the loop answers
    /health and /get_server_info, which shows the scheduler has not got the request yet
    (with the template on the loop, /get_server_info would only be answered after the
    request was submitted: the scheduler answers in the order it was asked)."""
    body = _chat(chat_template_kwargs={"spin": 600}, max_tokens=4)
    done = threading.Event()

    def big() -> None:
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
        done.set()

    thread = threading.Thread(target=big, daemon=True)
    thread.start()
    time.sleep(0.5)  # the request is in (its body is a few bytes)
    assert client.get("/health").status_code == 200
    assert _stats(client)["num_waiting_reqs"] == 0  # still rendering: nothing submitted
    assert not done.is_set()
    _wait_waiting(client, 1)  # it does arrive once rendered, and is held
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
    thread.join(60)
    assert done.is_set()


# ---------------------------------------------------------------------- item 2
LONG = "word " * 1200  # 6,000 characters
REFUSED = [
    # (route, body, status, flag)
    ("/generate", {"text": ["a"] * 9}, 400, "--max-prompts-per-request"),
    ("/generate", {"input_ids": [[1, 2]] * 9}, 400, "--max-prompts-per-request"),
    ("/generate", {"text": ["a", "b"], "sampling_params": {"n": 9}}, 400, "--max-sequences"),
    ("/generate", {"text": LONG}, 400, "--max-prompt-chars"),
    ("/generate", {"text": "Hi", "return_logprob": True, "top_logprobs_num": 6}, 400, "top-log"),
    (
        "/generate",
        {"text": "Hi", "return_logprob": True, "token_ids_logprob": [1, 2, 3, 4, 5, 6]},
        400,
        "--max-top-logprobs-num",
    ),
    (
        "/generate",
        {"text": "Hi", "sampling_params": {"logit_bias": {str(i): 1.0 for i in range(1000)}}},
        400,
        "--max-logit-bias",
    ),
    ("/generate", {"text": "Hi", "sampling_params": {"regex": "a" * 201}}, 400, "--max-grammar"),
    ("/generate", {"text": "x" * 300_000}, 413, "--max-request-bytes"),
    ("/v1/completions", {"model": "m", "prompt": ["a"] * 9}, 400, "--max-prompts-per-request"),
    ("/v1/completions", {"model": "m", "prompt": ["a", "b"], "n": 9}, 400, "--max-sequences"),
    ("/v1/completions", {"model": "m", "prompt": LONG}, 400, "--max-prompt-chars"),
    (
        "/v1/completions",
        {"model": "m", "prompt": "Hi", "logit_bias": {str(i): 1 for i in range(5)}},
        400,
        "--max-logit-bias",
    ),
    (
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "a"}] * 9},
        400,
        "--max-chat-messages",
    ),  # fmt: skip
    ("/v1/chat/completions", _chat(LONG), 400, "--max-prompt-chars"),
    (
        "/v1/chat/completions",
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"enum": ["a" * 300]}},
            }
        ),
        400,
        "--max-grammar-chars",
    ),
    ("/tokenize", {"prompt": ["a"] * 9}, 400, "--max-prompts-per-request"),
    ("/tokenize", {"prompt": LONG}, 400, "--max-prompt-chars"),
    ("/generate", {"text": "Hi", "x": json.loads("[" * 17 + "]" * 17)}, 400, "--max-json-depth"),
    (  # a JSON schema sent as text: its nesting too (the syntax check is slow when deep)
        "/generate",
        {"text": "Hi", "sampling_params": {"json_schema": '{"a":' * 17 + "1" + "}" * 17}},
        400,
        "--max-json-depth",
    ),
]


@pytest.mark.parametrize(
    "route,body,status,flag",
    REFUSED,
    ids=[f"{r}:{f}:{i}" for i, (r, _, _, f) in enumerate(REFUSED)],
)
def test_limits_refuse_with_a_short_message(client, route, body, status, flag):
    before = _stats(client)["num_prompt_tokens_total"]
    r = client.post(route, json=body)
    assert r.status_code == status, r.text
    assert flag in r.json()["error"]["message"]
    assert len(r.content) < 1000  # never the input echoed back
    assert _stats(client)["num_prompt_tokens_total"] == before


def test_chunked_body_over_the_limit_is_413(client):
    """No Content-Length: the bytes are counted as they arrive."""

    def chunks():
        for _ in range(40):
            yield b" " * 8192

    r = client.post("/generate", content=chunks(), headers=JSON)
    assert r.status_code == 413 and "--max-request-bytes" in r.text


def test_limits_leave_ordinary_requests_alone(client):
    r = client.post("/generate", json={"text": ["a", "b"], "sampling_params": {"n": 8}})
    assert r.status_code == 200 and len(r.json()) == 16
    body = {"text": "Hi", "return_logprob": True, "top_logprobs_num": 5}
    assert client.post("/generate", json=body).status_code == 200


# ---------------------------------------------------------------------- item 4
SURROGATE = '"a\\ud800b"'  # a JSON string holding a lone surrogate


def _bad(route: str, template: str, words: str) -> tuple[str, str, str]:
    """`template` with @ standing for SURROGATE."""
    return route, template.replace("@", SURROGATE), words


BAD_BYTES = [
    _bad("/generate", '{"text": @}', "text"),
    _bad("/generate", '{"text": ["ok", @]}', "text[1]"),
    _bad("/generate", '{"text": "Hi", "rid": @}', "rid"),
    _bad("/generate", '{"text": "Hi", "stream": true, "rid": @}', "rid"),
    _bad("/generate", '{"text": "Hi", "sampling_params": {"stop": [@]}}', "stop"),
    _bad("/v1/completions", '{"model": "m", "prompt": @}', "prompt"),
    _bad("/v1/completions", '{"model": "m", "prompt": "Hi", "stop": @}', "stop"),
    _bad(
        "/v1/chat/completions",
        '{"model": "m", "messages": [{"role": "user", "content": @}]}',
        "content",
    ),  # fmt: skip
    _bad("/v1/chat/completions", '{"model": "m", "rid": @, "messages": []}', "rid"),
    _bad("/tokenize", '{"prompt": @}', "prompt"),
    _bad(
        "/generate",
        '{"text": "Hi", "sampling_params": {"max_new_tokens": ' + "9" * 5000 + "}}",
        "digits",
    ),  # fmt: skip
    _bad("/generate", '{"text": "Hi", "sampling_params": {"seed": ' + "9" * 30 + "}}", "64 bits"),
    _bad("/generate", '{"text": "Hi", "sampling_params": {"temperature": 1e999}}', "out of range"),
    _bad("/generate", '{"text": "Hi", "sampling_params": {"temperature": NaN}}', "NaN"),
    _bad("/generate", '{"text": "Hi", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested"),
]


@pytest.mark.parametrize("route,raw,words", BAD_BYTES, ids=[w for _, _, w in BAD_BYTES])
def test_bad_bytes_and_numbers_are_400_before_any_work(client, route, raw, words):
    if len(raw) > LIMITS["--max-request-bytes"]:
        pytest.skip("over the body limit of this server")
    before = _stats(client)
    r = client.post(route, content=raw.encode(), headers=JSON)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    after = _stats(client)
    assert after["num_prompt_tokens_total"] == before["num_prompt_tokens_total"]
    assert after["num_running_reqs"] == 0


# ---------------------------------------------------------------------- item 5
@pytest.mark.parametrize(
    "headers",
    [{"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}, {}],
    ids=["text-plain", "form", "none"],
)
def test_json_routes_want_application_json(client, headers):
    """What a cross-site page can send without a preflight (and curl -d) is refused."""
    for route in ("/generate", "/abort_request", "/v1/completions", "/tokenize"):
        r = client.post(route, content=b'{"abort_all": true, "text": "Hi"}', headers=headers)
        assert r.status_code == 415, (route, r.text)
        assert "application/json" in r.json()["error"]["message"]


def test_state_changing_routes_are_post_only(client):
    assert client.get("/flush_cache").status_code == 405
    assert client.post("/flush_cache").status_code == 200  # no body, no Origin: curl, router


def test_an_origin_not_allowed_takes_no_effect(server, client):
    held = threading.Thread(
        target=httpx.post,
        args=(server.url + "/generate",),
        kwargs={"json": {"text": "__hold__"}, "timeout": 120},
        daemon=True,
    )
    held.start()
    _wait_waiting(client, 1)
    evil = {"Origin": "http://evil.example", **JSON}
    for route, body in [("/abort_request", {"abort_all": True}), ("/generate", {"text": "Hi"})]:
        r = client.post(route, json=body, headers=evil)
        assert r.status_code == 403 and "--allowed-origins" in r.text
    assert client.post("/flush_cache", headers=evil).status_code == 403
    assert _stats(client)["num_waiting_reqs"] == 1  # not aborted
    # an allowed page may, with JSON (which a browser only sends after a CORS preflight)
    ok = {"Origin": ORIGIN}
    assert client.post("/flush_cache", headers=ok).status_code == 415  # a browser: JSON only
    r = client.post("/abort_request", json={"abort_all": True}, headers=ok)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    held.join(60)
    _wait_waiting(client, 0)


# ---------------------------------------------------------------------- item 7
def test_completions_max_tokens_null_is_the_default_16(client):
    prompt = "Hello world! How are you today? " * 20
    null = client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": None})
    absent = client.post("/v1/completions", json={"model": "m", "prompt": prompt})
    assert null.status_code == absent.status_code == 200, null.text
    assert null.json()["usage"]["completion_tokens"] == 16
    assert null.json()["choices"][0]["finish_reason"] == "length"
    assert absent.json()["usage"]["completion_tokens"] == 16


def test_chat_max_tokens_null_is_up_to_the_context(client):
    """OpenAI chat: no limit but the context (the fake stops at the prompt's <|im_end|>)."""
    r = client.post("/v1/chat/completions", json=_chat("Hello world! " * 20, max_tokens=None))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 16
    assert r.json()["choices"][0]["finish_reason"] == "stop"


# ---------------------------------------------------------------------- item 8
@pytest.mark.parametrize("expose", [False, True], ids=["hidden", "exposed"])
def test_info_routes_hide_the_local_model_folder(tok_dir, tmp_path, expose):
    hf_home, repo = tmp_path / "hf", tmp_path / "repo"
    shutil.copytree(tok_dir, repo)
    (repo / "config.json").write_text("{}")  # what a snapshot must hold (the fake loads none)
    (repo / "model.safetensors").write_bytes(b"")
    snapshot = add_to_hub_cache(hf_home, "org/tiny-chat", repo)
    args = ["--model-path", "org/tiny-chat"] + (["--expose-local-paths"] if expose else [])
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    srv = start_server(args, tmp_path / "server.log", fake=True, env=env)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            texts = [c.get(p).text for p in ("/get_model_info", "/get_server_info", "/v1/models")]
            info = c.get("/get_model_info").json()
    finally:
        srv.stop()
    for text in texts:
        assert (str(snapshot) in text) == expose, text[:300]
        assert str(hf_home) in text if expose else str(hf_home) not in text
    assert info["model_path"] == (str(snapshot) if expose else "org/tiny-chat")
