"""tool_choice "required" and named functions: the JSON schema that enforces them and the
parsers of output generated under it.

The schemas do not depend on the model's native tool-call format (the grammar backend makes
the model write plain JSON):
- "required": an array of one or more calls (at most one when `parallel_tool_calls` is
  false), each `{"name": <one tool's name>, "parameters": <that tool's parameters>}`. Every
  tool is its own `anyOf` branch, so a call's parameters are checked against the schema of
  the function it names, not of any function.
- a named function: that function's parameters object itself; the call's name is known
  before generation starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglite.parsers.base import (
    BufferedParser,
    CallArgs,
    CallStart,
    Content,
    Event,
    StreamParser,
    new_call_id,
)
from sglite.parsers.json_call import FAILED, RUNNING, CallReader

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or ANY_OBJECT


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The schema of a call to this one tool (an OpenAI `{"type": "function", ...}`)."""
    return _parameters(tool)


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The schema of one or more calls to any of `tools` (see the module docstring)."""
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": branches[0] if len(branches) == 1 else {"anyOf": branches},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


class NamedCallParser(StreamParser):
    """The whole output is the arguments of one call to `name` (surrounding whitespace is
    dropped; an empty output is `{}`)."""

    def __init__(self, name: str, new_id: Callable[[], str] = new_call_id):
        self.name = name
        self.new_id = new_id
        self._started = False
        self._seen = False  # a non-whitespace character
        self._space = ""  # trailing whitespace held back

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        return [CallStart(0, self.new_id(), self.name)]

    def feed(self, text: str) -> list[Event]:
        out = self._start()
        if not self._seen:
            text = text.lstrip()
            self._seen = bool(text)
        body = self._space + text
        kept = body.rstrip()
        self._space = body[len(kept) :]
        if kept:
            out.append(CallArgs(0, kept))
        return out

    def finish(self) -> list[Event]:
        out = self._start()
        if not self._seen:
            out.append(CallArgs(0, "{}"))
        return out


class RequiredCallsParser(BufferedParser):
    """The output is a JSON array of call objects. Output that is not (a grammar backend
    that did not hold) is left as content from where it stops being one."""

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        self.calls = CallReader(new_id)
        self._buf = ""
        self._state = "open"  # open | item | call | after | done | text

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._state == "call":
            out += self.calls.finish()
            if not self.calls.scanner.announced:
                out.append(Content(self.calls.scanner.raw))
        elif self._state == "text":
            out.append(Content(self._buf))
        self._buf, self._state = "", "done"
        return out

    def _step(self, out: list[Event]) -> bool:
        state = self._state
        if state == "text":
            out.append(Content(self._buf))
            self._buf = ""
            return False
        if state == "done":
            self._buf = ""
            return False
        if state == "call":
            self._buf, status = self.calls.read(self._buf, out)
            if status == RUNNING:
                return False
            self._state = "text" if status == FAILED else "after"
            return True
        self._buf = self._buf.lstrip()
        if not self._buf:
            return False
        c = self._buf[0]
        expected = {"open": "[", "item": "{]", "after": ",]"}[state]
        if c not in expected:
            self._state = "text"
        elif c == "{":
            self.calls.begin()
            self._state = "call"
        else:
            self._buf = self._buf[1:]
            self._state = {"[": "item", ",": "item", "]": "done"}[c]
        return True
