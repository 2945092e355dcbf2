"""Reasoning blocks (`<think>...</think>`) split from the answer, chosen by
`--reasoning-parser` name.

| name | model | output |
|---|---|---|
| `qwen3` | Qwen3 (hybrid), QwQ | `<think>...</think>answer`; `enable_thinking: false` turns it off |
| `qwen3-thinking` | Qwen3 *-Thinking-2507 | starts inside the reasoning (the template opens it) |
| `deepseek-r1` | DeepSeek-R1 and its distills | starts inside the reasoning; `<think>` optional |
| `deepseek-v3` | DeepSeek-V3.1/3.2 | like qwen3, toggled by `thinking` (off by default) |
| `gpt-oss` | gpt-oss | harmony channels: `analysis` is reasoning, `final` the answer (parsers/harmony.py) |

Where the output starts: inside the reasoning when the format always thinks or when the
rendered prompt ends with the opening tag (templates that open the block for the model),
unless `chat_template_kwargs` turn thinking off (the format's toggle, `enable_thinking` or
`thinking` set to false): then the output starts as answer text. An answer text that begins
with the opening tag enters the reasoning all the same. Reasoning text is stripped of the
whitespace around it, the answer of the whitespace right after the closing tag. An output
that ends inside the reasoning (a length cut) is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglite.parsers.base import (
    BufferedParser,
    Content,
    Event,
    Reasoning,
    StreamParser,
    partial_tag_len,
)
from sglite.parsers.harmony import HarmonyParser

THINKING_SWITCHES = ("enable_thinking", "thinking")


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    always_thinks: bool = False
    toggle: str | None = None  # the chat_template_kwargs key that switches thinking
    default_on: bool = True
    start: str = "<think>"
    end: str = "</think>"
    harmony: bool = False  # gpt-oss's channels instead of a think block (parsers/harmony.py)
    # its tags are special tokens: the chat route keeps them in the decoded text
    needs_special_tokens: bool = False

    def thinking_enabled(self, template_kwargs: dict[str, Any] | None) -> bool:
        kwargs = template_kwargs or {}
        if any(kwargs.get(key) is False for key in THINKING_SWITCHES):
            return False
        if self.toggle is None:
            return True
        return bool(kwargs.get(self.toggle, self.default_on))

    def starts_in_reasoning(self, prompt: str, template_kwargs: dict[str, Any] | None) -> bool:
        if not self.thinking_enabled(template_kwargs):
            return False
        return self.always_thinks or prompt.rstrip().endswith(self.start)

    def parser(self, prompt: str, template_kwargs: dict[str, Any] | None) -> StreamParser:
        if self.harmony:
            return HarmonyParser(prompt)
        return ReasoningParser(self, self.starts_in_reasoning(prompt, template_kwargs))


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    f.name: f
    for f in (
        ReasoningFormat("qwen3", toggle="enable_thinking"),
        ReasoningFormat("qwen3-thinking", always_thinks=True),
        ReasoningFormat("deepseek-r1", always_thinks=True),
        ReasoningFormat("deepseek-v3", toggle="thinking", default_on=False),
        ReasoningFormat("gpt-oss", harmony=True, needs_special_tokens=True),
    )
}


def reasoning_format(name: str) -> ReasoningFormat:
    try:
        return REASONING_FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_FORMATS)}"
        ) from None


class ReasoningParser(BufferedParser):
    """Splits one output into Reasoning and Content events (see the module docstring)."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool):
        self.fmt = fmt
        # start: answer text that may still open with the start tag; think: inside the
        # reasoning; answer: after it (or never in it)
        self._state = "think" if in_reasoning else "start"
        self._lead = True  # whitespace (and, first thing, a start tag) to drop
        self._buf = ""

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if self._state == "think":
            return [Reasoning(buf.rstrip())]
        return [Content(buf)]

    def _step(self, out: list[Event]) -> bool:
        fmt = self.fmt
        if self._state == "answer":
            if self._lead:
                self._buf = self._buf.lstrip()
                self._lead = not self._buf
            out.append(Content(self._buf))
            self._buf = ""
            return False
        if self._state == "start":
            body = self._buf.lstrip()
            if body.startswith(fmt.start):
                self._buf, self._state = body[len(fmt.start) :], "think"
                return True
            if not body or fmt.start.startswith(body):
                return False  # undecided
            self._state, self._lead = "answer", False
            return True
        # think
        if self._lead:
            body = self._buf.lstrip()
            if body.startswith(fmt.start):  # a start tag the template had opened already
                body = body[len(fmt.start) :].lstrip()
            elif body and fmt.start.startswith(body):
                return False
            self._buf = body
            if not body:
                return False
            self._lead = False
        i = self._buf.find(fmt.end)
        if i >= 0:
            out.append(Reasoning(self._buf[:i].rstrip()))
            self._buf, self._state, self._lead = self._buf[i + len(fmt.end) :], "answer", True
            return True
        keep = partial_tag_len(self._buf, (fmt.end,))
        end = len(self._buf) - keep
        while end > 0 and self._buf[end - 1].isspace():
            end -= 1
        out.append(Reasoning(self._buf[:end]))
        self._buf = self._buf[end:]
        return False
