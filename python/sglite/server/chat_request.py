"""What a chat request asks for beyond its messages, checked once into a `ChatPlan`: tools
and tool_choice, earlier tool calls and tool results, chat-template kwargs, reasoning.

The plan says what reaches the chat template (the messages in the Hugging Face convention,
the tools, the kwargs), what the sampler must enforce (a JSON schema for tool_choice
"required" or a named function) and how the output is read (`ChatPlan.output_parser`).

tool_choice, as OpenAI and SGLang define it:
- "auto" (the default with tools): the model may call tools; calls are parsed out of its
  output by `--tool-call-parser` (without one, the tools reach the template but calls come
  back as text).
- "none": no parsing; the tools still reach the template (as OpenAI and vLLM do, so the
  model knows them; SGLang leaves them out).
- "required" / `{"type": "function", "function": {"name": ...}}`: the output is forced by
  the grammar backend into the JSON of parsers/constrained.py; a named function is the only
  tool the template sees (as in SGLang).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any

from sglite.parsers import (
    NamedCallParser,
    Pipeline,
    RequiredCallsParser,
    StreamParser,
    make_tool_parser,
    named_schema,
    reasoning_format,
    required_schema,
)
from sglite.server.inputs import RequestError
from sglite.server.protocol import ChatCompletionRequest

logger = logging.getLogger(__name__)
_warned_no_parser: list[bool] = []  # log the missing --tool-call-parser once

# apply_chat_template's own parameters: not for chat_template_kwargs to override
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


@dataclass(frozen=True)
class ChatPlan:
    """How one chat request is rendered, constrained and read back (module docstring)."""

    messages: list[dict[str, Any]]
    template_tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)  # extra SamplingParams
    tool_mode: str = "off"  # off | native | required | named
    tool_parser: str | None = None  # for "native"
    named_tool: str | None = None  # for "named"
    reasoning_parser: str | None = None  # None: the reasoning stays in the content

    @property
    def parses_output(self) -> bool:
        return self.tool_mode != "off" or self.reasoning_parser is not None

    def output_parser(self, prompt: str) -> StreamParser | None:
        """A fresh parser for one choice's output; `prompt` is the rendered prompt text
        (whether it opens a reasoning block decides where the output starts)."""
        if not self.parses_output:
            return None
        reasoning = None
        if self.reasoning_parser is not None:
            fmt = reasoning_format(self.reasoning_parser)
            reasoning = fmt.parser(prompt, self.template_kwargs)
        tools: StreamParser | None = None
        if self.tool_mode == "native":
            tools = make_tool_parser(self.tool_parser or "")
        elif self.tool_mode == "required":
            tools = RequiredCallsParser()
        elif self.tool_mode == "named":
            tools = NamedCallParser(self.named_tool or "")
        return Pipeline(reasoning, tools)


def plan_chat(
    req: ChatCompletionRequest,
    messages: list[dict[str, Any]],
    *,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> ChatPlan:
    """Check the request's tools, tool_choice, tool messages and template kwargs (a
    RequestError naming the field if wrong) and plan it. `messages` are the request's
    messages as role/content dicts, in order; the plan adds their tool fields."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    _check_tool_names(tools)
    choice = req.tool_choice or ("auto" if tools else "none")
    named = None if isinstance(choice, str) else choice.function.name
    if (choice == "required" or named) and not tools:
        raise RequestError(
            f"tool_choice: {'a named function' if named else repr(choice)} needs tools; "
            "give the functions in `tools`",
            param="tool_choice",
        )
    if named is not None and named not in {t["function"]["name"] for t in tools}:
        raise RequestError(
            f"tool_choice: function {named!r} is not in tools "
            f"({', '.join(t['function']['name'] for t in tools)})",
            param="tool_choice",
        )
    template_tools = [t for t in tools if named is None or t["function"]["name"] == named]
    mode, sampling = "off", {}
    if choice == "auto" and tools:
        mode = "native" if tool_call_parser else "off"
        if not tool_call_parser and not _warned_no_parser:
            _warned_no_parser.append(True)
            logger.warning(
                "a request gave tools but the server has no --tool-call-parser: the tools "
                "reach the chat template, tool calls come back as text"
            )
    elif choice == "required" or named is not None:
        mode = "required" if named is None else "named"
        sampling = _forced_call_sampling(tools, named, req.parallel_tool_calls)
    reasoning = reasoning_parser if req.separate_reasoning else None
    if reasoning and reasoning_format(reasoning).needs_special_tokens:
        if req.skip_special_tokens is None:  # the parser reads the format's special tokens
            sampling = {**sampling, "skip_special_tokens": False}
    return ChatPlan(
        messages=[
            _with_tool_fields(m, msg, i) for i, (m, msg) in enumerate(zip(req.messages, messages))
        ],
        template_tools=template_tools or None,
        template_kwargs=_template_kwargs(req.chat_template_kwargs),
        sampling=sampling,
        tool_mode=mode,
        tool_parser=tool_call_parser if mode == "native" else None,
        named_tool=named,
        reasoning_parser=reasoning,
    )


def _forced_call_sampling(
    tools: list[dict[str, Any]], named: str | None, parallel: bool
) -> dict[str, Any]:
    """The SamplingParams field that forces the calls: a JSON schema for the grammar
    backend (a 400 on a server started with --grammar-backend none)."""
    if named is None:
        schema = required_schema(tools, parallel=parallel)
    else:
        schema = named_schema(next(t for t in tools if t["function"]["name"] == named))
    return {"json_schema": json.dumps(schema)}


def _check_tool_names(tools: list[dict[str, Any]]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if not name or len(name) > 64 or any(c.isspace() for c in name):
            raise RequestError(
                f"tools[{i}].function.name: {name!r} is not a function name (1 to 64 "
                "characters, no spaces)",
                param="tools",
            )
        if name in seen:
            raise RequestError(
                f"tools[{i}].function.name: {name!r} is given twice; names must be unique",
                param="tools",
            )
        seen.add(name)


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    clash = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs or {}))
    if clash:
        raise RequestError(
            f"chat_template_kwargs: {', '.join(clash)} cannot be set this way (the server "
            "sets them); pass the template's own variables only",
            param="chat_template_kwargs",
        )
    return dict(kwargs or {})


def _with_tool_fields(message: Any, rendered: dict[str, Any], i: int) -> dict[str, Any]:
    """The message for the template, in the Hugging Face convention: an assistant's calls
    as `tool_calls` with arguments as objects (templates serialize them), a tool result
    with its `tool_call_id` (and `name`)."""
    out = dict(rendered)
    if message.role == "tool":
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            out["name"] = message.name
    if message.tool_calls:
        if message.role != "assistant":
            raise RequestError(
                f"messages[{i}].tool_calls: only assistant messages have tool calls",
                param="messages",
            )
        out["tool_calls"] = [
            _call_for_template(c, f"messages[{i}].tool_calls[{j}]")
            for j, c in enumerate(message.tool_calls)
        ]
    return out


def _call_for_template(call: dict[str, Any], where: str) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(
            f'{where}.function: give {{"name": ..., "arguments": ...}}', param="messages"
        )
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict):
        raise RequestError(
            f"{where}.function.arguments: must be a JSON object (as a string), got "
            f"{function.get('arguments')!r}",
            param="messages",
        )
    out: dict[str, Any] = {
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
