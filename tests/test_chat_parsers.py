"""The chat-output parsers (sglite/parsers): tool calls in the qwen/hermes and llama3 formats,
reasoning blocks, and the output of tool_choice "required"/named, each read whole and
incrementally. Every sample is also fed split at every point (and one character at a time):
the events must not depend on where the deltas were cut."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglite.parsers import (
    CallArgs,
    CallStart,
    Content,
    NamedCallParser,
    Pipeline,
    Reasoning,
    RequiredCallsParser,
    make_tool_parser,
    merge_events,
    reasoning_format,
)
from sglite.parsers.base import partial_tag_len


def _ids():
    n = iter(range(10**6))
    return lambda: f"call_{next(n)}"


def run(parser, pieces) -> list:
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return merge_events(events + parser.finish())


def canonical(events) -> list:
    """Events with call ids blanked (each parser instance numbers its own)."""
    return [CallStart(e.index, "id", e.name) if isinstance(e, CallStart) else e for e in events]


def check_splits(make, text: str) -> list:
    """The events of `text` fed whole; the same for every 2-way split and char by char."""
    whole = canonical(run(make(), [text]))
    for i in range(len(text) + 1):
        assert canonical(run(make(), [text[:i], text[i:]])) == whole, (text[:i], text[i:])
    assert canonical(run(make(), list(text))) == whole
    return whole


def call(i: int, name: str) -> CallStart:
    return CallStart(i, "id", name)


# ---------------------------------------------------------------------- qwen / hermes
QWEN = [
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
        [Content("Let me check."), call(0, "get_weather"), CallArgs(0, '{"city": "Paris"}')],
    ),
    (  # two calls, tag-like text inside a JSON string, text after the calls
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "b", '
        '"arguments": {"s": "</tool_call> {[\\"", "n": [1, {"k": null}]}}</tool_call>\nDone.',
        [
            call(0, "a"),
            CallArgs(0, '{"x": 1}'),
            call(1, "b"),
            CallArgs(1, '{"s": "</tool_call> {[\\"", "n": [1, {"k": null}]}'),
            Content("Done."),
        ],
    ),
    (  # not JSON inside the tags: left as content, exactly
        "Hi <tool_call>{name: f}</tool_call> bye",
        [Content("Hi <tool_call>{name: f}</tool_call> bye")],
    ),
    (  # an object without a name is not a call
        'x <tool_call>{"a": 1}</tool_call>',
        [Content('x <tool_call>{"a": 1}</tool_call>')],
    ),
    (  # malformed arguments of a named call: passed on as written (clients validate)
        '<tool_call>{"name": "f", "arguments": {"x": 1,, }}</tool_call>',
        [call(0, "f"), CallArgs(0, '{"x": 1,, }')],
    ),
    (  # garbage after the call object is dropped up to the end tag
        '<tool_call>{"name": "f", "arguments": {}} oops</tool_call>after',
        [call(0, "f"), CallArgs(0, "{}"), Content("after")],
    ),
    (  # arguments before the name; an escaped name
        '<tool_call>{"arguments": {"q": "x"}, "id": 7, "name": "se\\u0061rch"}</tool_call>',
        [call(0, "search"), CallArgs(0, '{"q": "x"}')],
    ),
    ('<tool_call>{"name": "now"}</tool_call>', [call(0, "now"), CallArgs(0, "{}")]),
    (  # arguments written as a JSON string
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        [call(0, "f"), CallArgs(0, '{"a": 1}')],
    ),
    (  # the end tag forgotten before the next call
        '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {}}',
        [call(0, "a"), CallArgs(0, "{}"), call(1, "b"), CallArgs(1, "{}")],
    ),
    (  # cut by the length limit inside the arguments
        'x <tool_call>{"name": "f", "arguments": {"a": [1, 2',
        [Content("x"), call(0, "f"), CallArgs(0, '{"a": [1, 2')],
    ),
    ('x <tool_call>{"na', [Content('x <tool_call>{"na')]),  # cut before the name
    (
        "Plain answer with < and <tool and <tool_call",
        [Content("Plain answer with < and <tool and <tool_call")],
    ),
    ("", []),
]


@pytest.mark.parametrize("text,expected", QWEN, ids=[t[:30] for t, _ in QWEN])
def test_qwen_tool_calls(text, expected):
    assert check_splits(lambda: make_tool_parser("qwen", _ids()), text) == expected


def test_parser_aliases_and_ids():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    for name in ("qwen", "qwen25", "hermes"):
        start = run(make_tool_parser(name), [text])[0]
        assert start.name == "f" and start.call_id.startswith("call_") and len(start.call_id) == 29
    with pytest.raises(ValueError, match="unknown tool-call parser 'gpt'.*qwen"):
        make_tool_parser("gpt")


# ---------------------------------------------------------------------- llama3
LLAMA3 = [
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        [call(0, "get_weather"), CallArgs(0, '{"city": "Paris"}')],
    ),
    (
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": 2}}',
        [call(0, "a"), CallArgs(0, "{}"), call(1, "b"), CallArgs(1, '{"n": 2}')],
    ),
    (
        'Sure. <|python_tag|>{"type": "function", "name": "a", "parameters": {"x": true}}',
        [Content("Sure."), call(0, "a"), CallArgs(0, '{"x": true}')],
    ),
    (
        '  {"name": "a", "arguments": {"x": null}}\n then text',
        [call(0, "a"), CallArgs(0, '{"x": null}'), Content("then text")],
    ),
    ("The answer is 4. ", [Content("The answer is 4. ")]),
    (' {"city": "Paris"} is JSON', [Content(' {"city": "Paris"} is JSON')]),  # no name
    ("<|python_tag|>print(1)", [Content("<|python_tag|>print(1)")]),  # code, not JSON
    ("<|python_ta", [Content("<|python_ta")]),
]


@pytest.mark.parametrize("text,expected", LLAMA3, ids=[t[:30] for t, _ in LLAMA3])
def test_llama3_tool_calls(text, expected):
    assert check_splits(lambda: make_tool_parser("llama3", _ids()), text) == expected


# Text that holds no complete tag comes back unchanged, however it is cut.
_ALPHABET = st.sampled_from(list('ab {}"<>/|_:;\n') + ["<tool_call>", "<|python_tag|>"])


@settings(max_examples=150, deadline=None)
@given(st.lists(_ALPHABET, max_size=30), st.lists(st.integers(0, 200), max_size=4))
def test_text_without_calls_is_unchanged(parts, cuts):
    text = "".join(parts)
    pieces, last = [], 0
    for cut in sorted(c % (len(text) + 1) for c in cuts):
        pieces.append(text[last:cut])
        last = cut
    pieces.append(text[last:])
    for name in ("qwen", "llama3"):
        events = run(make_tool_parser(name), pieces)
        if not any(isinstance(e, CallStart) for e in events):
            assert events == ([Content(text)] if text else []), (name, pieces)
        assert canonical(events) == canonical(run(make_tool_parser(name), [text]))


# ---------------------------------------------------------------------- reasoning
def _reasoning(name="qwen3", prompt="", kwargs=None):
    return lambda: reasoning_format(name).parser(prompt, kwargs)


REASONING = [
    # (parser, prompt, kwargs, output, expected)
    (
        "qwen3",
        "<|im_start|>assistant\n",
        None,
        "<think>\nI should add.\n</think>\n\nThe answer is 4.",
        [Reasoning("I should add."), Content("The answer is 4.")],
    ),
    ("qwen3", "", None, "No thinking here.\n", [Content("No thinking here.\n")]),
    ("qwen3", "", None, "<thinking> is a tag", [Content("<thinking> is a tag")]),
    ("qwen3", "", None, "  <think>still going ", [Reasoning("still going")]),  # length cut
    (  # the template opened the block: the output starts inside it
        "qwen3",
        "<|im_start|>assistant\n<think>\n",
        None,
        "Let me see.\n</think>\n\nThe answer",
        [Reasoning("Let me see."), Content("The answer")],
    ),
    (  # Qwen3 with enable_thinking=false: the template closed an empty block
        "qwen3",
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        {"enable_thinking": False},
        "Just 4. </think> is text",
        [Content("Just 4. </think> is text")],
    ),
    ("deepseek-r1", "", None, "<think>\nx y</think>z", [Reasoning("x y"), Content("z")]),
    ("deepseek-r1", "", None, "Hmm.</think>\n4", [Reasoning("Hmm."), Content("4")]),
    (  # thinking switched off: not the whole answer in reasoning_content
        "deepseek-r1",
        "",
        {"enable_thinking": False},
        "The answer is 4.",
        [Content("The answer is 4.")],
    ),
    ("qwen3-thinking", "", None, "a\n\nb</think>c", [Reasoning("a\n\nb"), Content("c")]),
    ("deepseek-v3", "<think>", None, "plain", [Content("plain")]),  # off unless thinking=true
    ("deepseek-v3", "<think>", {"thinking": True}, "r</think>a", [Reasoning("r"), Content("a")]),
]


@pytest.mark.parametrize("name,prompt,kwargs,text,expected", REASONING)
def test_reasoning(name, prompt, kwargs, text, expected):
    assert check_splits(_reasoning(name, prompt, kwargs), text) == expected


def test_reasoning_unknown_name():
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'.*qwen3"):
        reasoning_format("o1")


def test_reasoning_then_tool_calls():
    """Tool calls are parsed out of the answer only, never out of the reasoning."""
    text = (
        '<think>maybe <tool_call>{"name": "x", "arguments": {}}</tool_call></think>'
        'Ok <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    )

    def make():
        return Pipeline(_reasoning()(), make_tool_parser("qwen", _ids()))

    assert check_splits(make, text) == [
        Reasoning('maybe <tool_call>{"name": "x", "arguments": {}}</tool_call>'),
        Content("Ok"),
        call(0, "f"),
        CallArgs(0, '{"a": 1}'),
    ]


# ---------------------------------------------------------------------- tool_choice output
def test_required_calls_output():
    text = '\n[{"name": "a", "parameters": {"x": [1]}} ,\n {"parameters": {}, "name": "b"}]\n'
    assert check_splits(lambda: RequiredCallsParser(_ids()), text) == [
        call(0, "a"),
        CallArgs(0, '{"x": [1]}'),
        call(1, "b"),
        CallArgs(1, "{}"),
    ]
    assert check_splits(lambda: RequiredCallsParser(_ids()), "no JSON") == [Content("no JSON")]


def test_named_call_output():
    make = lambda: NamedCallParser("get_weather", _ids())  # noqa: E731
    assert check_splits(make, ' {"city": "Paris",\n "days": 2} \n') == [
        call(0, "get_weather"),
        CallArgs(0, '{"city": "Paris",\n "days": 2}'),
    ]
    assert check_splits(make, "") == [call(0, "get_weather"), CallArgs(0, "{}")]


def test_arguments_stream_as_generated():
    """A call is announced as soon as its name is complete and its arguments grow with the
    text, before the call is closed."""
    parser = make_tool_parser("qwen", _ids())
    assert merge_events(parser.feed('<tool_call>{"name": "get_wea')) == []
    assert canonical(merge_events(parser.feed('ther"'))) == [call(0, "get_weather")]
    assert merge_events(parser.feed(', "arguments": {"city": "Pa')) == [CallArgs(0, '{"city": "Pa')]
    assert merge_events(parser.feed('ris"}}</tool_')) == [CallArgs(0, 'ris"}')]
    assert merge_events(parser.feed("call>") + parser.finish()) == []


def test_partial_tag_len():
    assert partial_tag_len("abc <tool", ("<tool_call>",)) == 5
    assert partial_tag_len("abc <tool_call>", ("<tool_call>",)) == 0  # a whole tag: not partial
    assert partial_tag_len("x</", ("</think>", "<think>")) == 2
    assert partial_tag_len("", ("<a>",)) == 0


def test_valid_json_arguments_round_trip():
    args = {"q": 'quote " and </tool_call>', "n": [1.5, -2e3, True, None], "o": {"k": "ü"}}
    text = (
        f"<tool_call>{json.dumps({'name': 'f', 'arguments': args}, ensure_ascii=False)}</tool_call>"
    )
    events = check_splits(lambda: make_tool_parser("qwen", _ids()), text)
    assert json.loads(events[1].text) == args
