"""Structured output end to end: the real server on the tiny model (given a chat template),
through /generate, the `openai` client's completions and chat (`response_format`, streaming),
SGLang's `regex` / `ebnf` extras, and bad grammars answered with a 400 before they reach the
scheduler; `--grammar-backend none` refuses structured output with a 400."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from fixtures.serving import start_server

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "kind": {"enum": ["town", "village"]},
        "rivers": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["city", "population", "kind", "rivers"],
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "place", "schema": SCHEMA, "strict": True},
}
MESSAGES = [{"role": "user", "content": "Describe the river town as JSON."}]


@pytest.fixture(scope="module")
def srv(tiny_chat_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = ["--model-path", str(tiny_chat_model_dir), "--max-total-tokens", "8192",
            "--tool-call-parser", "qwen"]  # fmt: skip
    server = start_server([*args, "--served-model-name", "m"], log, fake=False)
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none")


def test_generate_with_json_schema(srv):
    for temperature, seed in ((0, None), (1.0, 3), (1.2, 4)):
        sp = {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 120, "temperature": temperature}
        r = httpx.post(
            srv.url + "/generate",
            json={"text": "The river town", "sampling_params": {**sp, "seed": seed}},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}, out
        jsonschema.validate(json.loads(out["text"]), SCHEMA)


def test_completions_response_format_json_schema(client):
    reply = client.completions.create(
        model="m",
        prompt="In the library",
        max_tokens=120,
        temperature=0.8,
        seed=1,
        n=2,
        extra_body={"response_format": RESPONSE_FORMAT},
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and choice.matched_stop == EOS
        jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_chat_response_format_json_schema(client):
    reply = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=120, temperature=0, response_format=RESPONSE_FORMAT
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_stream_response_format_json_schema(client):
    stream = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=120,
        temperature=1.0,
        seed=5,
        response_format=RESPONSE_FORMAT,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_chat_json_object_and_text(client):
    """json_object: any JSON object. A random model may never close one (greedy loops inside a
    key here), so: every output opens an object, and those that stop parse to a dict."""
    finished = 0
    for seed in range(3):
        reply = client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            max_tokens=60,
            temperature=0.7,
            seed=seed,
            response_format={"type": "json_object"},
        )
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert text.startswith("{"), text
        if finish == "stop":
            assert isinstance(json.loads(text), dict), text
            finished += 1
    assert finished
    free = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=8, temperature=0, response_format={"type": "text"}
    )
    plain = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=8, temperature=0
    )
    assert free.choices[0].message.content == plain.choices[0].message.content


def test_regex_and_ebnf_extras(client):
    regex = r"(red|green|blue)-[0-9]{2,4}"
    reply = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=40, temperature=0.9, extra_body={"regex": regex}
    )
    assert re.fullmatch(regex, reply.choices[0].message.content)
    ebnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
    reply = client.completions.create(
        model="m", prompt="Well", max_tokens=20, temperature=1.0, extra_body={"ebnf": ebnf}
    )
    assert re.fullmatch(r"yes|no|maybe [0-9]", reply.choices[0].text)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, 'json_schema: invalid schema: Unsupported type "objectx"'),
    ({"response_format": {"type": "json_schema"}}, "response_format: .*json_schema is required"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"regex": "a(b"}, "regex: invalid regex: .*parenthesis is not closed"),
    ({"ebnf": "root ::= nope"}, 'ebnf: invalid grammar: .*Rule "nope" is not defined'),
    ({"regex": "a", "response_format": {"type": "json_object"}}, "at most one of json_schema, regex and ebnf"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "message"), BAD, ids=lambda v: str(v)[:30])
def test_bad_grammars_are_400(client, extra, message):
    with pytest.raises(openai.BadRequestError) as chat_err:
        client.chat.completions.create(model="m", messages=MESSAGES, extra_body=extra)
    with pytest.raises(openai.BadRequestError) as completion_err:
        client.completions.create(model="m", prompt="x", extra_body=extra)
    for e in (chat_err.value, completion_err.value):
        assert e.status_code == 400 and re.search(message, e.body["message"]), e.body


def test_bad_grammar_on_generate_is_400_and_the_server_still_serves(srv):
    r = httpx.post(
        srv.url + "/generate",
        json={"text": "x", "sampling_params": {"json_schema": '{"type": "objectx"}'}},
        timeout=60,
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        'sampling_params: json_schema: invalid schema: Unsupported type "objectx"'
    )
    ok = httpx.post(
        srv.url + "/generate",
        json={"text": "x", "sampling_params": {"regex": "fine", "temperature": 0}},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["text"] == "fine"


def test_grammar_backend_none_is_400(tmp_path_factory):
    from fixtures.serving import build_tiny_tokenizer

    tok_dir = build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    log = tmp_path_factory.mktemp("log") / "server.log"
    server = start_server(
        ["--model-path", str(tok_dir), "--grammar-backend", "none"], log, fake=True, timeout=120
    )
    try:
        r = httpx.post(
            server.url + "/generate",
            json={"text": "x", "sampling_params": {"regex": "a+"}},
            timeout=60,
        )
        assert r.status_code == 400
        assert "structured output is disabled on this server" in r.json()["error"]["message"]
        ok = httpx.post(server.url + "/generate", json={"text": "x y z"}, timeout=60)
        assert ok.status_code == 200
    finally:
        server.stop()


def test_engine_structured_output(tiny_model_dir):
    import sglite

    with sglite.Engine(
        model_path=str(tiny_model_dir("llama")), max_total_tokens=2048, log_level="warning"
    ) as engine:
        sp = {
            "max_new_tokens": 120,
            "temperature": 0.9,
            "seed": 2,
            "json_schema": json.dumps(SCHEMA),
        }
        outs = engine.generate(["The river town", "Fishermen"], sp)
        for out in outs:
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
            jsonschema.validate(json.loads(out["text"]), SCHEMA)
        with pytest.raises(ValueError, match="regex: invalid regex: .*not closed"):
            engine.generate("x", {"regex": "a(b"})
        assert engine.generate("x", {"regex": "done", "temperature": 0})["text"] == "done"


def _tool(name: str, param: str, values: list[str]) -> dict:
    params = {
        "type": "object",
        "properties": {param: {"type": "string", "enum": values}},
        "required": [param],
    }
    return {"type": "function", "function": {"name": name, "parameters": params}}


TOOLS = [_tool("get_weather", "city", ["Paris", "Tokyo"]), _tool("get_time", "zone", ["UTC"])]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_tool_choice_on_the_real_model(client, choice):
    """tool_choice required / named: the grammar makes even a random model call a tool with
    arguments that follow its schema."""
    import jsonschema

    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=200,
        temperature=0,
    )
    choice_out = r.choices[0]
    assert choice_out.finish_reason == "tool_calls", choice_out
    calls = choice_out.message.tool_calls
    assert calls
    for call in calls:
        tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    if isinstance(choice, dict):
        assert {c.function.name for c in calls} == {"get_time"}
