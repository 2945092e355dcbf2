"""Planning a chat request (server/chat_request.py): what reaches the chat template for each
tool_choice, the tool-call history in the Hugging Face convention, the checks that answer
400, and the JSON schemas that enforce tool_choice "required" and named functions (checked
with jsonschema against calls the parsers read back)."""

from __future__ import annotations

import json

import pytest

from fixtures.tools import WEATHER
from sglite.parsers import CallArgs, CallStart, RequiredCallsParser, merge_events
from sglite.parsers.constrained import named_schema, required_schema
from sglite.server.chat_request import plan_chat
from sglite.server.inputs import RequestError
from sglite.server.protocol import ChatCompletionRequest

CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
NO_PARAMS = {"type": "function", "function": {"name": "now"}}


def _plan(tool_call_parser="qwen", reasoning_parser=None, **body):
    body.setdefault("model", "m")
    body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    req = ChatCompletionRequest.model_validate(body)
    messages = [{"role": m.role, "content": m.content or ""} for m in req.messages]
    return plan_chat(
        req, messages, tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser
    )


# ---------------------------------------------------------------------- tool_choice
def test_auto_parses_with_the_server_parser():
    plan = _plan(tools=[WEATHER, CLOCK])
    assert plan.tool_mode == "native" and plan.tool_parser == "qwen"
    assert [t["function"]["name"] for t in plan.template_tools] == ["get_weather", "get_time"]
    assert plan.template_tools[0] == WEATHER and plan.sampling == {}
    assert _plan(tools=[WEATHER], tool_choice="auto").tool_mode == "native"


def test_auto_without_a_parser_keeps_calls_as_text():
    plan = _plan(tool_call_parser=None, tools=[WEATHER])
    assert plan.tool_mode == "off" and plan.template_tools == [WEATHER]
    assert plan.output_parser("") is None


def test_none_keeps_tools_in_template_and_parses_nothing():
    plan = _plan(tools=[WEATHER], tool_choice="none")
    assert plan.tool_mode == "off" and plan.template_tools == [WEATHER]
    assert plan.output_parser("") is None


def test_no_tools():
    plan = _plan()
    assert plan.tool_mode == "off" and plan.template_tools is None and plan.sampling == {}


def test_named_function():
    plan = _plan(
        tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert plan.tool_mode == "named" and plan.named_tool == "get_time"
    assert plan.template_tools == [CLOCK]  # the only tool the template sees, as in SGLang
    assert json.loads(plan.sampling["json_schema"]) == CLOCK["function"]["parameters"]


def test_required():
    plan = _plan(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
    assert plan.tool_mode == "required" and plan.template_tools == [WEATHER, CLOCK]
    schema = json.loads(plan.sampling["json_schema"])
    assert schema == required_schema([WEATHER, CLOCK], parallel=False)


@pytest.mark.parametrize(
    "body,words",
    [
        ({"tool_choice": "required"}, ["tool_choice", "needs tools"]),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            ["tool_choice", "'x'", "get_weather"],
        ),
        ({"tools": [WEATHER, WEATHER]}, ["tools[1].function.name", "twice"]),
        ({"tools": [{"function": {"name": "a b"}}]}, ["tools[0].function.name"]),
        ({"chat_template_kwargs": {"tools": []}}, ["chat_template_kwargs", "tools"]),
        (
            {
                "messages": [
                    {"role": "user", "content": "w?"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}],
                    },
                ]
            },
            ["messages[1].tool_calls[0].function.arguments", "JSON object"],
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]},
            ["messages[0].tool_calls", "assistant"],
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}
                ]
            },
            ["messages[0].tool_calls[0].function"],
        ),
    ],
)
def test_bad_requests(body, words):
    with pytest.raises(RequestError) as e:
        _plan(**body)
    assert e.value.status_code == 400
    for w in words:
        assert w in e.value.message, e.value.message


# ---------------------------------------------------------------------- messages, kwargs
def test_tool_history_in_hf_convention():
    plan = _plan(
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "22C"},
        ]
    )
    assistant, tool = plan.messages[1], plan.messages[2]
    assert assistant["content"] == "" and assistant["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }
    ]
    assert tool == {
        "role": "tool",
        "content": "22C",
        "tool_call_id": "call_1",
        "name": "get_weather",
    }


def test_template_kwargs_and_reasoning():
    plan = _plan(reasoning_parser="qwen3", chat_template_kwargs={"enable_thinking": False})
    assert plan.template_kwargs == {"enable_thinking": False}
    assert plan.reasoning_parser == "qwen3" and plan.parses_output
    assert _plan(reasoning_parser="qwen3", separate_reasoning=False).reasoning_parser is None


def test_output_parsers_follow_the_plan():
    native = _plan(tools=[WEATHER], reasoning_parser="deepseek-r1").output_parser("")
    events = merge_events(
        native.feed('r</think><tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
        + native.finish()
    )
    assert [type(e).__name__ for e in events] == ["Reasoning", "CallStart", "CallArgs"]
    named = _plan(
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    ).output_parser("")
    start = merge_events(named.feed('{"city": "Rome"}') + named.finish())
    assert start[0].name == "get_weather" and start[1] == CallArgs(0, '{"city": "Rome"}')


# ---------------------------------------------------------------------- schemas
def test_schemas_accept_calls_and_reject_mismatches():
    jsonschema = pytest.importorskip("jsonschema")
    schema = required_schema([WEATHER, CLOCK, NO_PARAMS])
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [
        {"name": "get_weather", "parameters": {"city": "Paris"}},
        {"name": "get_time", "parameters": {"zone": "UTC"}},
        {"name": "now", "parameters": {}},
    ]
    jsonschema.validate(ok, schema)
    bad = [
        [],  # at least one call
        [{"name": "get_time", "parameters": {"city": "Paris"}}],  # another tool's parameters
        [{"name": "get_weather", "parameters": {}}],  # its required argument missing
        [{"name": "send_mail", "parameters": {}}],  # not a tool
        [{"name": "now"}],  # no parameters
        [{"name": "now", "parameters": {}, "extra": 1}],
    ]
    for calls in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(calls, schema)
    single = required_schema([WEATHER, CLOCK], parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok[:2], single)
    jsonschema.validate(ok[:1], single)
    assert named_schema(NO_PARAMS) == {"type": "object"}
    jsonschema.validate({"zone": "CET"}, named_schema(CLOCK))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"zone": "PST"}, named_schema(CLOCK))


def test_schema_valid_output_reads_back_as_the_calls():
    calls = [
        {"name": "get_weather", "parameters": {"city": "Zürich"}},
        {"name": "get_time", "parameters": {"zone": "CET"}},
    ]
    text = json.dumps(calls, ensure_ascii=False, indent=2)
    parser = RequiredCallsParser()
    events = merge_events(parser.feed(text) + parser.finish())
    starts = [e for e in events if isinstance(e, CallStart)]
    args = [json.loads(e.text) for e in events if isinstance(e, CallArgs)]
    assert [s.name for s in starts] == ["get_weather", "get_time"]
    assert args == [c["parameters"] for c in calls]
    assert len({s.call_id for s in starts}) == 2
