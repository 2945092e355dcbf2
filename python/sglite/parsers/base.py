"""The contract of the chat-output parsers: ordered events from text deltas, held-back tags.

A parser reads the text a model generates, delta by delta, and turns it into an ordered list
of events: reasoning text, answer text (content), the start of a tool call (its index, id and
name) and pieces of a call's arguments. Text that might still be the beginning of a tag
(`<tool_` of `<tool_call>`) is held back until the next delta decides it, or until `finish()`.
Contract of every `StreamParser`: feeding a text whole, or in any number of pieces, and then
calling `finish()`, yields the same events once adjacent events of one kind are merged
(`merge_events`). A parser is stateful and serves one generated sequence.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass

from sglite.detokenizer import stop_prefix_len


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    """A tool call begins: always before any of its CallArgs."""

    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    """The next piece of call `index`'s arguments (JSON text, in generation order)."""

    index: int
    text: str


Event = Reasoning | Content | CallStart | CallArgs


def new_call_id() -> str:
    """An OpenAI-style tool-call id: `call_` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


class StreamParser(ABC):
    """Incremental text -> events (see the module docstring for the contract)."""

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """The events that the text so far settles."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """The output ended: the events of whatever was held back."""


class BufferedParser(StreamParser):
    """A parser over a text buffer: `feed` appends the delta and runs `_step` until it
    needs more text (`_step` returns False) or the buffer is empty."""

    _buf: str

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._buf and self._step(out):
            pass
        return out

    @abstractmethod
    def _step(self, out: list[Event]) -> bool:
        """Consume from `_buf`, appending events; False: wait for more text."""


def partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `tags`:
    the characters that must be held back because the next delta may complete a tag (the
    detokenizer's hold-back of stop strings, the same question)."""
    return stop_prefix_len(text, tags)


def merge_events(events: list[Event]) -> list[Event]:
    """Join adjacent text events of one kind (and adjacent arguments of one call); drop
    empty text. The canonical form in which two event lists are compared."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, (Content, Reasoning, CallArgs)) and not e.text:
            continue
        last = out[-1] if out else None
        if isinstance(e, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + e.text)
        elif isinstance(e, Reasoning) and isinstance(last, Reasoning):
            out[-1] = Reasoning(last.text + e.text)
        elif isinstance(e, CallArgs) and isinstance(last, CallArgs) and last.index == e.index:
            out[-1] = CallArgs(e.index, last.text + e.text)
        else:
            out.append(e)
    return out


class Pipeline(StreamParser):
    """Reasoning split first, then tool calls parsed out of the content (never out of the
    reasoning). Either stage may be absent."""

    def __init__(self, reasoning: StreamParser | None, tools: StreamParser | None):
        self.reasoning = reasoning
        self.tools = tools

    def _through_tools(self, events: list[Event]) -> list[Event]:
        if self.tools is None:
            return events
        out: list[Event] = []
        for e in events:
            out += self.tools.feed(e.text) if isinstance(e, Content) else [e]
        return out

    def feed(self, text: str) -> list[Event]:
        events = self.reasoning.feed(text) if self.reasoning else [Content(text)]
        return merge_events(self._through_tools(events))

    def finish(self) -> list[Event]:
        events = self._through_tools(self.reasoning.finish() if self.reasoning else [])
        if self.tools is not None:
            events += self.tools.finish()
        return merge_events(events)
