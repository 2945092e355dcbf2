"""gpt-oss's harmony format: `--reasoning-parser gpt-oss`, the chat template, the stop tokens.

The parser on fixed harmony outputs, fed whole, split at every point and one character at a
time (the events must not depend on the cuts). The harmony template of fixtures/harmony.py
renders every role and an assistant's reasoning in the analysis channel. Through the real
server's OpenAI chat route: with the model-free fake scheduler answering the harmony text the
echo template renders, `reasoning_content` and `content` come back split, whole and
streamed; on the tiny gpt-oss with the harmony tokenizer, a request returns 200 with the
split of the raw text (special tokens kept) that the same request returns unsplit, and the
stop tokens `<|return|>` and `<|call|>` are the model's EOS ids.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from fixtures.harmony import ECHO_TEMPLATE, build_harmony_tokenizer, harmony_model_dir
from fixtures.serving import start_server
from sglite.parsers import Content, Reasoning, merge_events, reasoning_format

A, F = "<|start|>assistant<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final"
CASES = [
    # (prompt, output, events)
    (
        "<|start|>assistant",
        "<|channel|>analysis<|message|>Add 2 and 2.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>",
        [Reasoning("Add 2 and 2."), Content("It is 4.")],
    ),
    (  # the stop token trimmed; text kept exactly (spaces, newlines)
        "<|start|>assistant",
        "<|channel|>analysis<|message|> a\n<|end|><|start|>assistant<|channel|>final<|message|> b ",
        [Reasoning(" a\n"), Content(" b ")],
    ),
    (  # a length cut inside the reasoning, and one inside a header: no header text leaks
        "<|start|>assistant",
        "<|channel|>analysis<|message|>still thinking",
        [Reasoning("still thinking")],
    ),
    (
        "<|start|>assistant",
        "<|channel|>analysis<|message|>r<|end|><|start|>assist",
        [Reasoning("r")],
    ),
    (  # a tool-call preamble and a call in commentary: content (not parsed as calls)
        "<|start|>assistant",
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>",
        [Content("{}")],
    ),
    (  # the prompt opened the final channel: the output starts in it
        "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>",
        "Hello<|return|>",
        [Content("Hello")],
    ),
    ("<|start|>assistant", "no harmony at all <|end", [Content("no harmony at all <|end")]),
    (  # two analysis messages, a message without its end token before the next header
        "",
        f"<|channel|>analysis<|message|>x<|end|>{A}y{F}<|message|>z",
        [Reasoning("xy"), Content("z")],
    ),
]


def _run(parser, pieces) -> list:
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return merge_events(events + parser.finish())


@pytest.mark.parametrize("prompt,text,expected", CASES)
def test_parser_splits_harmony_output(prompt, text, expected):
    fmt = reasoning_format("gpt-oss")
    assert fmt.needs_special_tokens
    whole = _run(fmt.parser(prompt, None), [text])
    assert whole == expected
    for i in range(len(text) + 1):
        assert _run(fmt.parser(prompt, None), [text[:i], text[i:]]) == whole, i
    assert _run(fmt.parser(prompt, None), list(text)) == whole


def test_template_renders_every_role(tmp_path):
    tok = build_harmony_tokenizer(tmp_path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add."},
        {"role": "user", "content": "3+3?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|start|>system<|message|>Be brief.<|end|>"
        "<|start|>developer<|message|>Answer in English.<|end|>"
        "<|start|>user<|message|>2+2?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Add.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>4<|end|>"
        "<|start|>user<|message|>3+3?<|end|>"
        "<|start|>assistant"
    )
    ids = tok(text)["input_ids"]
    assert tok.convert_tokens_to_ids("<|start|>") in ids and len(ids) < len(text) / 2


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _stream(client, **kwargs) -> tuple[str, str]:
    reasoning = content = ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
    return reasoning, content


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory):
    tok = tmp_path_factory.mktemp("harmony_tok")
    build_harmony_tokenizer(tok, template=ECHO_TEMPLATE)
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = ["--model-path", str(tok), "--context-length", "1024", "--served-model-name", "m"]
    srv = start_server([*args, "--reasoning-parser", "gpt-oss"], log, fake=True, timeout=120)
    yield srv
    srv.stop()


def test_chat_route_splits_reasoning_whole_and_streamed(echo_server):
    client = _client(echo_server)
    user = [{"role": "user", "content": "The river town|woke slowly."}]
    r = client.chat.completions.create(model="m", messages=user)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == ("The river town", "woke slowly.")
    assert r.choices[0].finish_reason == "stop"
    assert _stream(client, model="m", messages=user) == ("The river town", "woke slowly.")
    # a request that drops the special tokens itself gets no split (its choice)
    r = client.chat.completions.create(model="m", messages=user, extra_body={
        "skip_special_tokens": True})  # fmt: skip
    assert r.choices[0].message.content.startswith("analysis")
    # reasoning_content is accepted on an assistant turn, refused by name on a user turn
    history = [{"role": "assistant", "content": "|x", "reasoning_content": "r"}, *user]
    assert client.chat.completions.create(model="m", messages=history).choices[0].message.content
    bad = httpx.post(echo_server.url + "/v1/chat/completions", timeout=30, json={
        "model": "m", "messages": [{**user[0], "reasoning_content": "r"}]})  # fmt: skip
    assert bad.status_code == 400 and "messages[0].reasoning_content" in bad.text, bad.text


@pytest.fixture(scope="module")
def model_server(tiny_model_dir, tmp_path_factory):
    path = harmony_model_dir(tiny_model_dir("gpt_oss"), tmp_path_factory.mktemp("harmony_m"))
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = ["--model-path", str(path), "--served-model-name", "m", "--max-total-tokens", "1024"]
    srv = start_server([*args, "--reasoning-parser", "gpt-oss"], log, fake=False, timeout=240)
    yield srv, path
    srv.stop()


def test_tiny_gpt_oss_through_the_chat_route(model_server):
    from transformers import AutoTokenizer

    from sglite.models.model_config import ModelConfig
    from sglite.parsers.harmony import HarmonyParser

    server, path = model_server
    tok = AutoTokenizer.from_pretrained(str(path))
    stops = tuple(tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>"))
    assert ModelConfig.from_pretrained(path).eos_token_ids == stops
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "The river town woke slowly."}],
        "max_tokens": 24,
        "temperature": 0,
    }
    raw = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        **body, "separate_reasoning": False, "skip_special_tokens": False})  # fmt: skip
    assert raw.status_code == 200, raw.text
    text = raw.json()["choices"][0]["message"]["content"]
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    parser = HarmonyParser("<|start|>assistant")
    events = merge_events(parser.feed(text) + parser.finish())
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning)) or None
    content = "".join(e.text for e in events if isinstance(e, Content))
    assert (message.get("reasoning_content"), message["content"] or "") == (reasoning, content)
    assert _stream(_client(server), **body) == (reasoning or "", content)
