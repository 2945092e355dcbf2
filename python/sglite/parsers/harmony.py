"""gpt-oss's harmony output split into reasoning and answer (`--reasoning-parser gpt-oss`).

Harmony frames every message with special tokens: a header `<|start|>{role}<|channel|>
{channel}` (optionally ` to={recipient}` and `<|constrain|>{type}`), then `<|message|>`, the
text, and an end token: `<|end|>`, `<|return|>` (the last answer) or `<|call|>` (a tool
call). The chat template's generation prompt is `<|start|>assistant`, so an output reads

    <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

The text of `analysis` messages is reasoning; of `final` (and `commentary`, the tool-call
preambles and calls, which sglite does not parse as tool calls) the content. Text outside a
header (a model that skipped the format) is content. `<|return|>` and `<|call|>` are stop
tokens (generation_config's eos ids), so the last end token is usually not in the text.
Message texts are kept exactly (no whitespace stripped). The tokens are special tokens: the
chat route keeps them in the decoded text for this parser (`skip_special_tokens` false
unless the request sets it).
"""

from __future__ import annotations

from sglite.parsers.base import BufferedParser, Content, Event, Reasoning, partial_tag_len

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END_TOKENS = ("<|end|>", "<|return|>", "<|call|>")
# where a message's text stops: its end, or (an end left out) the next message's header
BODY_STOPS = (*END_TOKENS, START, CHANNEL)
HEADER_OPENERS = (START, CHANNEL)
REASONING_CHANNELS = ("analysis",)


def channel_of(header: str) -> str | None:
    """The channel a header names (`<|channel|>final to=x` -> `final`), None without one."""
    i = header.rfind(CHANNEL)
    if i < 0:
        return None
    rest = header[i + len(CHANNEL) :]
    for sep in (" ", "<|"):
        rest = rest.split(sep, 1)[0]
    return rest.strip() or None


class HarmonyParser(BufferedParser):
    """One output's harmony messages -> Reasoning and Content events."""

    def __init__(self, prompt: str = ""):
        self._buf = ""
        self._channel: str | None = None
        # the prompt may end inside a header (`<|start|>assistant`) or open a message body
        # (`...<|channel|>final<|message|>`): the output then starts in that body
        tail = prompt.rstrip()
        if tail.endswith(MESSAGE):
            self._state = "body"
            self._channel = channel_of(tail[: -len(MESSAGE)].rsplit(START, 1)[-1])
        else:
            self._state = "header"

    def _text(self, text: str) -> Event:
        return Reasoning(text) if self._channel in REASONING_CHANNELS else Content(text)

    def finish(self) -> list[Event]:
        buf, self._buf = self._buf, ""
        if not buf:
            return []
        if self._state == "header":
            # an unfinished header (a length cut) carries no text; anything else is content
            return [] if buf.lstrip().startswith(HEADER_OPENERS) else [Content(buf)]
        return [self._text(buf)]

    def _step(self, out: list[Event]) -> bool:
        if self._state == "header":
            return self._header()
        return self._body(out)

    def _header(self) -> bool:
        body = self._buf.lstrip()
        if not body.startswith(HEADER_OPENERS):
            if not body or any(t.startswith(body) for t in HEADER_OPENERS):
                return False  # undecided
            self._state, self._channel = "body", None  # no header: plain content
            return True
        i = self._buf.find(MESSAGE)
        if i < 0:
            return False  # the header goes on
        self._channel = channel_of(self._buf[:i])
        self._buf, self._state = self._buf[i + len(MESSAGE) :], "body"
        return True

    def _body(self, out: list[Event]) -> bool:
        hits = [(i, t) for t in BODY_STOPS if (i := self._buf.find(t)) >= 0]
        if hits:
            i, token = min(hits)
            if i:
                out.append(self._text(self._buf[:i]))
            # an end token closes the message; a header opener starts the next one
            skip = len(token) if token in END_TOKENS else 0
            self._buf, self._state = self._buf[i + skip :], "header"
            return True
        keep = partial_tag_len(self._buf, BODY_STOPS)
        end = len(self._buf) - keep
        if end:
            out.append(self._text(self._buf[:end]))
            self._buf = self._buf[end:]
        return False
