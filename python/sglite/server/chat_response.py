"""One chat choice's generated text as OpenAI returns it: a message (content,
reasoning_content, tool_calls) or the stream of deltas that builds the same message.

`ChoiceReader` wraps the choice's output parser (`ChatPlan.output_parser`, or none: then the
text is the content, unchanged). Both the response and the stream go through it, so the
streamed deltas add up to the message. A choice that made tool calls and stopped by itself
finishes with "tool_calls" (a length cut stays "length").
"""

from __future__ import annotations

from typing import Any

from sglite.parsers import CallArgs, CallStart, Content, Event, Reasoning, StreamParser
from sglite.server.protocol import (
    ChatDelta,
    ChatMessageOut,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)

FinishedDelta = tuple[ChatDelta, str | None, int | str | None]


def _delta(event: Event) -> ChatDelta:
    if isinstance(event, Content):
        return ChatDelta(content=event.text)
    if isinstance(event, Reasoning):
        return ChatDelta(reasoning_content=event.text)
    if isinstance(event, CallStart):
        function = DeltaFunctionCall(name=event.name, arguments="")
        call = DeltaToolCall(
            index=event.index, id=event.call_id, type="function", function=function
        )
    else:
        assert isinstance(event, CallArgs)
        call = DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.text))
    return ChatDelta(tool_calls=[call])


class ChoiceReader:
    """Reads one choice's output, whole (`message`) or delta by delta (`step`)."""

    def __init__(self, parser: StreamParser | None):
        self.parser = parser
        self.num_calls = 0

    def _events(self, text: str, finished: bool) -> list[Event]:
        assert self.parser is not None
        events = self.parser.feed(text) if text else []
        if finished:
            events += self.parser.finish()
        self.num_calls += sum(isinstance(e, CallStart) for e in events)
        return events

    def finish_reason(self, reason: dict[str, Any] | None) -> tuple[str | None, Any]:
        """OpenAI's finish_reason and SGLang's matched_stop for the scheduler's reason."""
        if reason is None:
            return None, None
        if self.num_calls and reason.get("type") == "stop":
            return "tool_calls", None
        return str(reason.get("type")), reason.get("matched")

    def step(self, text: str, reason: dict[str, Any] | None) -> list[FinishedDelta]:
        """The deltas for the next piece of text; the last of a finished choice carries the
        finish reason (an empty delta if nothing else is left to send)."""
        finished = reason is not None
        if self.parser is None:
            if not text and not finished:
                return []
            return [(ChatDelta(content=text), *self.finish_reason(reason))]
        out: list[FinishedDelta] = [(_delta(e), None, None) for e in self._events(text, finished)]
        if finished:
            last = out.pop()[0] if out else ChatDelta()
            out.append((last, *self.finish_reason(reason)))
        return out

    def message(self, text: str, reason: dict[str, Any] | None) -> tuple[ChatMessageOut, Any, Any]:
        """The whole output as (message, finish_reason, matched_stop)."""
        if self.parser is None:
            return ChatMessageOut(content=text), *self.finish_reason(reason)
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        for e in self._events(text, True):
            if isinstance(e, Content):
                content.append(e.text)
            elif isinstance(e, Reasoning):
                reasoning.append(e.text)
            elif isinstance(e, CallStart):
                calls.append(
                    ToolCall(id=e.call_id, function=FunctionCall(name=e.name, arguments=""))
                )
            else:
                call = calls[e.index].function
                call.arguments += e.text
        answer = "".join(content)
        message = ChatMessageOut(
            content=answer if answer or not calls else None,
            reasoning_content="".join(reasoning) or None,
            tool_calls=calls or None,
        )
        return message, *self.finish_reason(reason)


def reader_for(plan: Any, prompt: str | None) -> ChoiceReader:
    """The reader of one choice of a request planned as `plan` (a ChatPlan, or None for a
    request without one), whose rendered prompt was `prompt`."""
    return ChoiceReader(plan.output_parser(prompt or "") if plan is not None else None)
