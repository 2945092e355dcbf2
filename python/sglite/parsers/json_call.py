"""Reading one tool call's JSON object incrementally: the name once it is complete, the
arguments as they are generated.

`CallScanner` consumes `{"name": "f", "arguments": {...}}` character by character (the key
"parameters" is read as "arguments", as Llama 3 writes it; other keys are skipped; keys may
come in any order, arguments seen before the name are held until the name is known). An
object-valued arguments field is passed on verbatim, piece by piece, so that the client sees
it grow; the arguments are the model's own text and may be invalid JSON if the model wrote
invalid JSON (OpenAI's contract: clients validate `function.arguments`). A string-valued
arguments field is decoded (some models write the JSON as a string); a missing one is `{}`.

The scanner checks the structure of the outer object only. It fails on the first character
that cannot continue it, or when the object closes without a name; that character is left
unconsumed for the caller, which also gets everything consumed so far (`raw`) back to show as
text. A call is *announced* once its name is known: after that a failure only ends it.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from sglite.parsers.base import CallArgs, CallStart, Content, Event

RUNNING, DONE, FAILED = "running", "done", "failed"
ARGUMENT_KEYS = ("arguments", "parameters")
_SCALAR_START = set("-0123456789tfn")


class CallScanner:
    """One call object, fed incrementally (see the module docstring)."""

    def __init__(self) -> None:
        self.status = RUNNING
        self.raw = ""  # everything consumed
        self.name: str | None = None
        self.has_args = False
        self._out: list[tuple[str, str]] = []  # ("name", name)
        self._args: list[str] = []  # pieces of arguments not yet taken
        self._early_args: list[str] = []  # arguments read before the name
        self._state = "open"
        self._first_key = True
        self._key = ""
        self._role = "skip"  # what the current value is: name | args | skip
        self._kind = ""  # container | string | scalar
        self._value = ""  # the current value's text, when it is needed (name, held arguments)
        self._keep = False
        self._streaming = False  # the current value is streamed as arguments
        self._depth = 0
        self._in_string = False
        self._escaped = False

    @property
    def announced(self) -> bool:
        return self.name is not None

    def take(self) -> list[tuple[str, str]]:
        """The output since the last take: the name (once), then arguments text."""
        out, self._out = self._out, []
        if self._args:
            out.append(("args", "".join(self._args)))
            self._args = []
        return out

    def feed(self, text: str) -> int:
        """Consume from `text` until it ends or the object is done or failed; returns how
        many characters were consumed."""
        i = 0
        while i < len(text) and self.status == RUNNING:
            if self._step(text[i]):
                i += 1
        self.raw += text[:i]
        return i

    def finish(self) -> None:
        """The output ended inside the object: pass on what an announced call has."""
        if self.status != RUNNING or self.name is None:
            return
        if self._state == "in_value" and self._role == "args" and not self._streaming:
            self._emit_args(self._value)
        elif not self.has_args:
            self._emit_args("{}")

    # ------------------------------------------------------------------ internals
    def _emit_args(self, text: str) -> None:
        (self._args if self.name is not None else self._early_args).append(text)

    def _fail(self) -> bool:
        self.status = FAILED
        return False

    def _close(self) -> bool:
        if self.name is None:
            self.status = FAILED
            return True
        if not self.has_args:
            self._emit_args("{}")
        self.status = DONE
        return True

    def _step(self, c: str) -> bool:
        """Process one character; False when it is left unconsumed (a failure, or the
        delimiter that ended a number or literal, which the next state reads again)."""
        state = self._state
        if state == "in_value":
            return self._value_char(c)
        if state == "in_key":
            self._key += c
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._state = "colon"
            return True
        if c.isspace():
            return True
        if state == "open":
            if c != "{":
                return self._fail()
            self._state = "key"
            return True
        if state == "key":
            if c == '"':
                self._key, self._state, self._escaped = c, "in_key", False
                return True
            return self._close() if c == "}" and self._first_key else self._fail()
        if state == "colon":
            if c != ":":
                return self._fail()
            self._state = "value"
            return True
        if state == "value":
            return self._value_start(c)
        # after a value
        if c == ",":
            self._state, self._first_key = "key", False
            return True
        return self._close() if c == "}" else self._fail()

    def _value_start(self, c: str) -> bool:
        try:
            key = json.loads(self._key)
        except ValueError:
            return self._fail()
        if c in "{[":
            self._kind, self._depth = "container", 1
        elif c == '"':
            self._kind = "string"
        elif c in _SCALAR_START:
            self._kind = "scalar"
        else:
            return self._fail()
        if key == "name" and self.name is None:
            if self._kind != "string":
                return self._fail()
            self._role = "name"
        elif key in ARGUMENT_KEYS and not self.has_args:
            self._role, self.has_args = "args", True
        else:
            self._role = "skip"
        self._streaming = self._role == "args" and c == "{"
        self._keep = self._role == "name" or (self._role == "args" and not self._streaming)
        self._value, self._in_string, self._escaped = c, False, False
        self._state = "in_value"
        if self._streaming:
            self._emit_args(c)
        return True

    def _value_char(self, c: str) -> bool:
        if self._kind == "scalar":
            if c in ",}]" or c.isspace():
                self._end_value()
                return False  # the delimiter belongs to the object
            self._value += c
            return True
        if self._keep:
            self._value += c
        elif self._streaming:
            self._emit_args(c)
        if self._kind == "string" or self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                if self._kind == "string":
                    self._end_value()
                self._in_string = False
            return True
        if c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._end_value()
        return True

    def _end_value(self) -> None:
        self._state = "after"
        if self._role == "name":
            try:
                name = json.loads(self._value)
            except ValueError:
                name = None
            if not isinstance(name, str) or not name:
                self.status = FAILED
                return
            self.name = name
            self._out.append(("name", name))
            self._args += self._early_args
            self._early_args = []
        elif self._role == "args" and not self._streaming:
            self._emit_args(_decoded_arguments(self._value))


def _decoded_arguments(value: str) -> str:
    if value == "null":
        return "{}"
    if value.startswith('"'):
        try:
            decoded = json.loads(value)
        except ValueError:
            return value
        return decoded if isinstance(decoded, str) else value
    return value


class CallReader:
    """Numbers the calls of one output and turns each scanner's output into events."""

    def __init__(self, new_id: Callable[[], str]):
        self.new_id = new_id
        self.num_calls = 0
        self.scanner = CallScanner()

    def begin(self) -> CallScanner:
        self.scanner = CallScanner()
        return self.scanner

    def events(self) -> list[Event]:
        out: list[Event] = []
        for kind, text in self.scanner.take():
            if kind == "name":
                out.append(CallStart(self.num_calls, self.new_id(), text))
                self.num_calls += 1
            else:
                out.append(CallArgs(self.num_calls - 1, text))
        return out

    def feed(self, text: str) -> tuple[int, list[Event]]:
        n = self.scanner.feed(text)
        return n, self.events()

    def read(self, buf: str, out: list[Event], shown_if_failed: str = "") -> tuple[str, str]:
        """Feed `buf` to the current call, appending its events to `out`. Returns (the rest of
        `buf`, the call's status: RUNNING while it is still being written). A call that failed
        before its name was announced is given back as content: `shown_if_failed` (what the
        parser consumed before the call object) and the call's raw text."""
        n, events = self.feed(buf)
        out += events
        scanner = self.scanner
        if scanner.status == FAILED and not scanner.announced:
            out.append(Content(shown_if_failed + scanner.raw))
        return buf[n:], scanner.status

    def finish(self) -> list[Event]:
        self.scanner.finish()
        return self.events()
