"""Tool calls and reasoning end to end: the real server (`--tool-call-parser qwen
--reasoning-parser qwen3`) with the model-free fake scheduler, driven by the `openai` client.

The fake scheduler answers with the prompt's own tokens up to its first <|im_end|>, and the
chat template of fixtures/chat_templates.py renders there what the "model" should write,
built from what the template received (the tools, earlier tool calls, the template kwargs).
So each answer is generated token by token, detokenized incrementally and parsed by the
server exactly as a real model's, and it shows what reached the template.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from fixtures.chat_templates import build_echo_tokenizer
from fixtures.serving import start_server
from fixtures.tools import WEATHER

CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
USER = [{"role": "user", "content": "Checking."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok = build_echo_tokenizer(tmp_path_factory.mktemp("tok"))
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = ["--model-path", str(tok), "--context-length", "4096", "--served-model-name", "m"]
    args += ["--tool-call-parser", "qwen", "--reasoning-parser", "qwen3"]
    srv = start_server(args, log, fake=True, timeout=120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def collect_stream(stream) -> dict:
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id.startswith("call_") and tc.type == "function", tc
                    calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
                else:
                    assert tc.id is None and tc.function.name is None, tc
                    calls[tc.index][1] += tc.function.arguments
            finish = choice.finish_reason or finish
    return {
        "content": content,
        "reasoning": reasoning,
        "calls": list(calls.values()),
        "finish": finish,
    }


def test_tool_call(client):
    r = client.chat.completions.create(model="m", messages=USER, tools=[CLOCK, WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
    # The template wrote a call of the last tool with its parameters schema as arguments.
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == WEATHER["function"]["parameters"]


def test_tool_call_streamed(client):
    stream = client.chat.completions.create(
        model="m", messages=USER, tools=[CLOCK, WEATHER], stream=True
    )
    got = collect_stream(stream)
    assert got["content"] == "Checking." and got["finish"] == "tool_calls"
    assert len(got["calls"]) == 1 and got["calls"][0][0] == "get_weather"
    assert json.loads(got["calls"][0][1]) == WEATHER["function"]["parameters"]


def test_tool_choice_none_keeps_the_text(client):
    r = client.chat.completions.create(
        model="m", messages=USER, tools=[WEATHER], tool_choice="none"
    )
    choice = r.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content.startswith('Checking.<tool_call>{"name": "get_weather"')


def test_tool_results_reach_the_template(client):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_7",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_7", "content": "22C"},
    ]
    r = client.chat.completions.create(model="m", messages=messages)
    assert r.choices[0].message.content == 'get_weather({"city": "Paris"}) [call_7] -> call_7: 22C'


def test_reasoning(client):
    kwargs = {"chat_template_kwargs": {"enable_thinking": True}}
    messages = [{"role": "user", "content": "First, 2+2.\n</think>\n\nIt is 4."}]
    r = client.chat.completions.create(model="m", messages=messages, extra_body=kwargs)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == ("First, 2+2.", "It is 4.")
    got = collect_stream(
        client.chat.completions.create(model="m", messages=messages, stream=True, extra_body=kwargs)
    )
    assert (got["reasoning"], got["content"], got["finish"]) == ("First, 2+2.", "It is 4.", "stop")
    raw = client.chat.completions.create(
        model="m", messages=messages, extra_body={**kwargs, "separate_reasoning": False}
    )
    assert raw.choices[0].message.content == messages[0]["content"]


def test_thinking_off_is_not_all_reasoning(client):
    """enable_thinking=false: the template does not open the block, the answer is content."""
    messages = [{"role": "user", "content": "It is 4."}]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(model="m", messages=messages, extra_body=off)
    assert r.choices[0].message.content == "It is 4."
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    # The model opening the block itself is split all the same.
    messages = [{"role": "user", "content": "<think>Easy.</think>It is 4."}]
    r = client.chat.completions.create(model="m", messages=messages)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (
        "Easy.",
        "It is 4.",
    )


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_choice(server, choice):
    body = {"model": "m", "messages": USER, "tools": [CLOCK, WEATHER], "tool_choice": choice}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text  # enforced by the grammar backend (not by the fake)
    if isinstance(choice, dict):
        assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == (
            "get_weather"
        )


BAD = [
    ({"tool_choice": "sometimes"}, ["tool_choice"]),
    ({"tools": [{"type": "function"}]}, ["tools[0].function"]),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, ["tools[0].type"]),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}}, ["'f'"]),
    ({"tool_choice": "required"}, ["tool_choice", "needs tools"]),
    ({"tools": [WEATHER, WEATHER]}, ["tools[1].function.name"]),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, ["chat_template_kwargs"]),
    ({"chat_template_kwargs": "thinking"}, ["chat_template_kwargs"]),
    ({"separate_reasoning": "yes"}, ["separate_reasoning"]),
    (
        {
            "messages": [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
                },
            ]
        },
        ["messages[1].tool_calls[0].function.arguments"],
    ),
]


@pytest.mark.parametrize("extra,words", BAD, ids=[str(b)[:40] for b, _ in BAD])
def test_bad_tool_requests_are_400(server, extra, words):
    body = {"model": "m", "messages": USER, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    for w in words:
        assert w in r.json()["error"]["message"], r.json()
    ok = httpx.post(
        server.url + "/v1/chat/completions", json={"model": "m", "messages": USER}, timeout=30
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "Checking."


# ---------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smol(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "smol.log"
    args = ["--model-path", str(smollm2_dir), "--max-total-tokens", "4096"]
    args += [
        "--served-model-name",
        "m",
        "--tool-call-parser",
        "qwen",
        "--reasoning-parser",
        "qwen3",
    ]
    srv = start_server(args, log, fake=False, timeout=300)
    yield srv
    assert srv.stop() == 0, srv.log()


def test_smollm2_plain_answer_passes_the_parsers_unchanged(smol, smollm2_dir):
    """A real model that answers in prose (SmolLM2's template ignores tools): with both
    parsers on, the message is the greedy text of /generate on the same prompt."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    body = {
        "input_ids": tok.encode(prompt, add_special_tokens=False),
        "sampling_params": {"max_new_tokens": 16, "temperature": 0},
    }
    ref = httpx.post(smol.url + "/generate", json=body, timeout=120)
    client = openai.OpenAI(base_url=smol.url + "/v1", api_key="none", max_retries=0)
    kw = dict(model="m", messages=messages, tools=[WEATHER], max_tokens=16, temperature=0)
    r = client.chat.completions.create(**kw)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.content == ref.json()["text"]
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason != "tool_calls"
    got = collect_stream(client.chat.completions.create(**kw, stream=True))
    assert (got["content"], got["reasoning"], got["calls"]) == (ref.json()["text"], "", [])
