"""Tool calls in the formats models write them natively, chosen by `--tool-call-parser` name.

- `qwen` (aliases `qwen25`, `hermes`; Qwen 2.5/3, Hermes, QwQ): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; text before, between or after
  the calls is content (whitespace around calls is dropped).
- `llama3` (Llama 3.1/3.2/3.3 JSON tool calling): the output is one or more
  `{"name": ..., "parameters": {...}}` objects separated by `;`, either from its start or
  after `<|python_tag|>`; text after the calls is content.

A block that is not a call object (not JSON, no name) is left as content, tags and all. An
output without calls comes back as the same content the model wrote. Parsers follow the
`StreamParser` contract of parsers/base.py; call objects are read by parsers/json_call.py.
"""

from __future__ import annotations

from collections.abc import Callable

from sglite.parsers.base import (
    BufferedParser,
    Content,
    Event,
    StreamParser,
    new_call_id,
    partial_tag_len,
)
from sglite.parsers.json_call import DONE, FAILED, RUNNING, CallReader


def _scan_to_tag(buf: str, tag: str, out: list[Event]) -> tuple[str, str, bool]:
    """Emit the text of `buf` before `tag` as content. Returns (the whitespace just before the
    tag, the rest of `buf` after it, True); without the tag yet, ("", the held-back end of
    `buf`: a possible partial tag and the whitespace before it, False)."""
    i = buf.find(tag)
    if i < 0:
        end = _split_trailing_space(buf, partial_tag_len(buf, (tag,)))
        out.append(Content(buf[:end]))
        return "", buf[end:], False
    before = buf[:i].rstrip()
    out.append(Content(before))
    return buf[len(before) : i], buf[i + len(tag) :], True


def _split_trailing_space(text: str, keep: int) -> int:
    """How much of `text` can be emitted: not the last `keep` characters (a possible tag)
    nor the whitespace before them (dropped if a call follows)."""
    end = len(text) - keep
    while end > 0 and text[end - 1].isspace():
        end -= 1
    return end


class _StateParser(BufferedParser):
    """A tool-call format as a state machine: state `name` is consumed by `self._name(out)`."""

    _state: str

    def _step(self, out: list[Event]) -> bool:
        return getattr(self, "_" + self._state)(out)


class HermesToolParser(_StateParser):
    """`<tool_call>{json}</tool_call>` blocks (see the module docstring)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        self.calls = CallReader(new_id)
        self._buf = ""
        self._state = "text"  # text | call | after (between a call object and its end tag)
        self._strip = False  # drop whitespace that follows a call
        self._space = ""  # whitespace before the current call's tag (shown if it fails)

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._state == "call":
            out += self.calls.finish()
            if not self.calls.scanner.announced:
                out.append(Content(self._space + self.START + self.calls.scanner.raw))
        elif self._state == "text" and not self._strip:
            out.append(Content(self._buf))
        self._buf, self._state = "", "text"
        return out

    def _text(self, out: list[Event]) -> bool:
        if self._strip:
            self._buf = self._buf.lstrip()
            self._strip = not self._buf
            if self._strip:
                return False
        self._space, self._buf, found = _scan_to_tag(self._buf, self.START, out)
        if not found:
            return False
        self.calls.begin()
        self._state = "call"
        return True

    def _call(self, out: list[Event]) -> bool:
        self._buf, status = self.calls.read(self._buf, out, self._space + self.START)
        if status == RUNNING:
            return False
        failed = status == FAILED and not self.calls.scanner.announced
        self._state = "text" if failed else "after"
        return True

    def _after(self, out: list[Event]) -> bool:
        buf = self._buf
        end, start = buf.find(self.END), buf.find(self.START)
        if end >= 0 and (start < 0 or end < start):
            self._buf = buf[end + len(self.END) :]
        elif start >= 0:  # the end tag was forgotten: the next call begins
            self._buf = buf[start:]
        else:
            self._buf = buf[len(buf) - partial_tag_len(buf, (self.END, self.START)) :]
            return False
        self._state, self._strip = "text", True
        return True


class Llama3ToolParser(_StateParser):
    """`{"name": ..., "parameters": ...}` objects, `;`-separated, at the start of the output
    or after `<|python_tag|>` (see the module docstring)."""

    TAG = "<|python_tag|>"

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        self.calls = CallReader(new_id)
        self._buf = ""
        self._state = "start"  # start | text | expect (a call may follow) | call | between
        self._prefix = ""  # text consumed before the current call object (shown if it fails)

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._state == "call":
            out += self.calls.finish()
            if not self.calls.scanner.announced:
                out.append(Content(self._prefix + self.calls.scanner.raw))
        elif self._state in ("start", "text"):
            out.append(Content(self._buf))
        elif self._state == "expect" and self.TAG in self._prefix:
            out.append(Content(self._prefix + self._buf))
        self._buf, self._state, self._prefix = "", "text", ""
        return out

    def _begin_call(self) -> bool:
        self.calls.begin()
        self._state = "call"
        return True

    def _start(self, out: list[Event]) -> bool:
        body = self._buf.lstrip()
        space = self._buf[: len(self._buf) - len(body)]
        if not body or (self.TAG.startswith(body) and body != self.TAG):
            return False  # undecided: only whitespace or part of the tag so far
        if body.startswith(self.TAG):
            self._prefix, self._buf, self._state = space + self.TAG, body[len(self.TAG) :], "expect"
            return True
        if body[0] == "{":
            self._prefix, self._buf = space, body
            return self._begin_call()
        self._state = "text"
        return True

    def _text(self, out: list[Event]) -> bool:
        space, self._buf, found = _scan_to_tag(self._buf, self.TAG, out)
        if not found:
            return False
        self._prefix, self._state = space + self.TAG, "expect"
        return True

    def _expect(self, out: list[Event]) -> bool:
        body = self._buf.lstrip()
        self._prefix += self._buf[: len(self._buf) - len(body)]
        self._buf = body
        if not body:
            return False
        if body[0] == "{":
            return self._begin_call()
        out.append(Content(self._prefix))  # not a call after all
        self._prefix, self._state = "", "text"
        return True

    def _call(self, out: list[Event]) -> bool:
        self._buf, status = self.calls.read(self._buf, out, self._prefix)
        if status == RUNNING:
            return False
        self._state = "between" if status == DONE else "text"
        self._prefix = ""
        return True

    def _between(self, out: list[Event]) -> bool:
        self._buf = self._buf.lstrip()  # whitespace after a call is dropped
        if not self._buf:
            return False
        if self._buf[0] == ";":
            self._prefix, self._buf, self._state = ";", self._buf[1:], "expect"
            return True
        if self._buf[0] == "{":
            return self._begin_call()
        self._state = "text"
        return True


TOOL_CALL_PARSERS: dict[str, type[StreamParser]] = {
    "qwen": HermesToolParser,
    "qwen25": HermesToolParser,
    "hermes": HermesToolParser,
    "llama3": Llama3ToolParser,
}


def make_tool_parser(name: str, new_id: Callable[[], str] = new_call_id) -> StreamParser:
    """The `--tool-call-parser` named `name` (one of TOOL_CALL_PARSERS)."""
    try:
        cls = TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}"
        ) from None
    return cls(new_id)  # type: ignore[call-arg]
