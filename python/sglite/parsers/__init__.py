"""Parsers of generated chat text: reasoning blocks and tool calls, whole or incremental.

- base.py: the events (Reasoning, Content, CallStart, CallArgs), the StreamParser contract,
  the Pipeline that runs reasoning first and tool calls on the answer text
- reasoning.py: `--reasoning-parser` formats (REASONING_FORMATS); harmony.py: gpt-oss's
  channels (analysis: reasoning, final: answer)
- tool_formats.py: `--tool-call-parser` formats (TOOL_CALL_PARSERS)
- constrained.py: tool_choice "required" / named: the JSON schemas and their parsers
- json_call.py: the incremental reader of one call's JSON object
"""

from sglite.parsers.base import (
    CallArgs,
    CallStart,
    Content,
    Event,
    Pipeline,
    Reasoning,
    StreamParser,
    merge_events,
    new_call_id,
)
from sglite.parsers.constrained import (
    NamedCallParser,
    RequiredCallsParser,
    named_schema,
    required_schema,
)
from sglite.parsers.reasoning import REASONING_FORMATS, ReasoningFormat, reasoning_format
from sglite.parsers.tool_formats import TOOL_CALL_PARSERS, make_tool_parser

__all__ = [
    "REASONING_FORMATS",
    "TOOL_CALL_PARSERS",
    "CallArgs",
    "CallStart",
    "Content",
    "Event",
    "NamedCallParser",
    "Pipeline",
    "Reasoning",
    "ReasoningFormat",
    "RequiredCallsParser",
    "StreamParser",
    "make_tool_parser",
    "merge_events",
    "named_schema",
    "new_call_id",
    "reasoning_format",
    "required_schema",
]
