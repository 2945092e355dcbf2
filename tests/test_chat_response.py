"""Chat responses with tool calls and reasoning, assembled by the handler's own code
(server/openai_api.py over server/chat_response.py) from scripted text streams: a stand-in
TokenizerManager plays back fixed text deltas, the real chat template renders the prompt.
The non-streamed message and the sum of the streamed deltas must agree, whatever the deltas,
and both must be what the `openai` client's types accept."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from fixtures.chat_templates import build_echo_tokenizer
from sglite.server import openai_api
from sglite.server.chat_response import ChoiceReader
from sglite.server.inputs import InputProcessor, RequestError
from sglite.server.protocol import ChatCompletionRequest, StreamOptions

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
)
STOP = {"type": "stop", "matched": 2}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(build_echo_tokenizer(tmp_path_factory.mktemp("t"))))


class ScriptedManager:
    """The parts of TokenizerManager the OpenAI handlers use, playing back `pieces` (the
    text deltas of every choice) and finishing with `reason`."""

    def __init__(self, tokenizer, pieces: list[str], reason: dict[str, Any], **server_args):
        self.server_args = SimpleNamespace(model_path="m", **server_args)
        self.served_model_name = "m"
        self.cache_report = False
        self.inputs = InputProcessor(tokenizer, context_length=4096, vocab_size=len(tokenizer))
        self.pieces, self.reason = pieces, reason
        self.prompts: list[Any] = []

    def _output(self, text: str, reason: dict[str, Any] | None) -> dict[str, Any]:
        meta = {"finish_reason": reason, "completion_tokens": 5, "cached_tokens": 0}
        return {"text": text, "meta_info": meta}

    async def collect(self, prompts, is_disconnected=None):
        self.prompts = prompts
        return [self._output("".join(self.pieces), self.reason) for _ in prompts]

    async def submit(self, prompts, stream):
        self.prompts = prompts
        return list(prompts)

    async def follow(self, states, stream):
        text = ""
        for k, piece in enumerate(self.pieces):
            text += piece
            last = k == len(self.pieces) - 1
            for i in range(len(states)):
                yield i, self._output(text, self.reason if last else None)


def _request(**body) -> ChatCompletionRequest:
    body.setdefault("model", "m")
    body.setdefault("messages", [{"role": "user", "content": "Weather?"}])
    return ChatCompletionRequest.model_validate(body)


def _complete(tm, req) -> ChatCompletion:
    resp = asyncio.run(openai_api.chat(tm, req, None))
    return ChatCompletion.model_validate(resp)


def _stream(tm, req) -> list[ChatCompletionChunk]:
    usage = StreamOptions(include_usage=True)
    req = req.model_copy(update={"stream": True, "stream_options": usage})

    async def run() -> list[str]:
        prompts, lens = openai_api.chat_prompts(tm, req)
        events = await openai_api.stream_openai(tm, prompts, lens, req, chat=True)
        return [e async for e in events]

    lines = asyncio.run(run())
    assert lines[-1] == "data: [DONE]\n\n"
    return [ChatCompletionChunk.model_validate(json.loads(x[6:])) for x in lines[:-1]]


def accumulate(chunks: list[ChatCompletionChunk], index: int = 0) -> dict[str, Any]:
    """What a client builds from the deltas of one choice (as the openai SDK does)."""
    content, reasoning, calls, finish = "", "", {}, None
    for c in chunks:
        for choice in c.choices:
            if choice.index != index:
                continue
            d = choice.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:  # the first delta of a call: id, type, name
                    assert tc.id and tc.type == "function" and tc.function.name, tc
                    assert tc.function.arguments == ""
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:  # then only more arguments
                    assert tc.id is None and tc.function.name is None, tc
                    calls[tc.index]["arguments"] += tc.function.arguments
            finish = choice.finish_reason or finish
    return {
        "content": content,
        "reasoning": reasoning,
        "calls": [calls[i] for i in sorted(calls)],
        "finish": finish,
    }


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_tool_calls_message_and_stream_agree(tokenizer, size):
    tm = ScriptedManager(tokenizer, _pieces(CALLS, size), STOP, tool_call_parser="qwen")
    message = _complete(tm, _request(tools=[WEATHER])).choices[0]
    assert message.finish_reason == "tool_calls"
    assert message.message.content == "Let me check."
    calls = message.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.function.arguments) for c in calls] == [
        {"city": "Paris"},
        {"city": "Rome"},
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id

    streamed = accumulate(_stream(tm, _request(tools=[WEATHER], stream=True)))
    assert streamed["content"] == "Let me check." and streamed["finish"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_reasoning_from_a_prompt_that_opens_it(tokenizer):
    """The template opens <think> when enable_thinking is set: the output starts inside it."""
    text = "First, 2+2.\n</think>\n\nIt is 4."
    tm = ScriptedManager(tokenizer, _pieces(text, 2), STOP, reasoning_parser="qwen3")
    kwargs = {"chat_template_kwargs": {"enable_thinking": True}}
    message = _complete(tm, _request(**kwargs)).choices[0].message
    assert tm.prompts[0].input_text.endswith("<think>\n")  # the kwargs reached the template
    assert (message.reasoning_content, message.content) == ("First, 2+2.", "It is 4.")
    streamed = accumulate(_stream(tm, _request(stream=True, **kwargs)))
    assert (streamed["reasoning"], streamed["content"]) == ("First, 2+2.", "It is 4.")
    assert streamed["finish"] == "stop"

    plain = _complete(tm, _request(chat_template_kwargs={"enable_thinking": False}))
    assert plain.choices[0].message.content == text  # not opened: nothing is reasoning
    assert plain.choices[0].message.reasoning_content is None
    raw = _complete(tm, _request(separate_reasoning=False, **kwargs))
    assert raw.choices[0].message.content == text


def test_reasoning_and_tool_calls_together(tokenizer):
    text = "<think>I need the weather.</think>\n" + CALLS
    tm = ScriptedManager(
        tokenizer, _pieces(text, 4), STOP, tool_call_parser="qwen", reasoning_parser="qwen3"
    )
    message = _complete(tm, _request(tools=[WEATHER])).choices[0].message
    assert message.reasoning_content == "I need the weather."
    assert message.content == "Let me check." and len(message.tool_calls) == 2
    streamed = accumulate(_stream(tm, _request(tools=[WEATHER], stream=True)))
    assert streamed["reasoning"] == "I need the weather." and len(streamed["calls"]) == 2


def test_length_cut_call_keeps_length(tokenizer):
    text = '<tool_call>{"name": "get_weather", "arguments": {"ci'
    tm = ScriptedManager(
        tokenizer, _pieces(text, 5), {"type": "length", "length": 9}, tool_call_parser="qwen"
    )
    choice = _complete(tm, _request(tools=[WEATHER])).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.tool_calls[0].function.arguments == '{"ci'


def test_tool_choice_none_and_no_parser_return_the_text(tokenizer):
    tm = ScriptedManager(tokenizer, _pieces(CALLS, 6), STOP, tool_call_parser="qwen")
    for req in (_request(tools=[WEATHER], tool_choice="none"), _request()):
        choice = _complete(tm, req).choices[0]
        assert choice.message.content == CALLS and choice.message.tool_calls is None
        assert choice.finish_reason == "stop" and choice.matched_stop == 2
    chunks = _stream(tm, _request(tools=[WEATHER], tool_choice="none", stream=True))
    assert accumulate(chunks)["content"] == CALLS
    assert chunks[-1].usage.completion_tokens == 5


def test_n_choices_parse_independently(tokenizer):
    tm = ScriptedManager(tokenizer, _pieces(CALLS, 5), STOP, tool_call_parser="qwen")
    response = _complete(tm, _request(tools=[WEATHER], n=2))
    ids = [c.id for choice in response.choices for c in choice.message.tool_calls]
    assert len(ids) == 4 and len(set(ids)) == 4
    chunks = _stream(tm, _request(tools=[WEATHER], n=2, stream=True))
    for i in range(2):
        assert [c["arguments"] for c in accumulate(chunks, i)["calls"]] == [
            '{"city": "Paris"}',
            '{"city": "Rome"}',
        ]


def test_reader_without_parser_is_unchanged():
    """No parser: the deltas are the text as before (a final delta with content "")."""
    reader = ChoiceReader(None)
    assert reader.step("", None) == []
    assert [(d.content, fr) for d, fr, _ in reader.step("ab", None)] == [("ab", None)]
    assert [(d.content, fr, ms) for d, fr, ms in reader.step("", STOP)] == [("", "stop", 2)]
    message, reason, matched = ChoiceReader(None).message("x<tool_call>", STOP)
    assert (message.content, message.tool_calls, reason, matched) == (
        "x<tool_call>",
        None,
        "stop",
        2,
    )


def test_forced_call_and_another_constraint_is_400(tokenizer):
    """After the grammar merge a request could constrain its output twice (response_format
    and a forced tool call): refused, not one silently dropped."""
    tm = ScriptedManager(tokenizer, ["x"], STOP)
    req = SimpleNamespace(
        stream_options=None,
        rid=None,
        sampling_dict=lambda budget: {"max_new_tokens": budget, "json_schema": "{}"},
    )
    with pytest.raises(RequestError, match="both constrain the output") as e:
        openai_api._prompts_for(
            tm,
            req,
            [([1, 2], None, "messages")],
            4,
            "max_tokens",
            extra_sampling={"json_schema": "[]"},
        )
    assert e.value.param == "tool_choice"
