"""Request and response bodies of the HTTP API (native /generate and OpenAI-compatible).

Request models are strict (a string is not a number, "yes" is not a boolean) so that wrong
types become a 400 naming the field; unknown top-level keys are ignored, as OpenAI clients
send extras. Value ranges are checked by SamplingParams and the TokenizerManager.

Structured output on the OpenAI routes: `response_format` `{"type": "text"}` (none),
`{"type": "json_object"}` (any JSON object: the schema `{"type": "object"}`), or
`{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`
(the output follows the schema; `strict` is accepted, and the output is always strict); and
SGLang's extras `regex` and `ebnf`. At most one of them per request.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's max_tokens default for /v1/completions


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class GenerateRequest(_Request):
    """POST /generate (SGLang's native API)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool | None = None
    priority: int | None = None  # --enable-priority-scheduling (all prompts of a batch)

    def logprob_fields(self) -> dict[str, Any]:
        return {
            "return_logprob": self.return_logprob,
            "logprob_start_len": self.logprob_start_len,
            "top_logprobs_num": self.top_logprobs_num,
            "token_ids_logprob": self.token_ids_logprob,
            "return_text_in_logprobs": self.return_text_in_logprobs,
        }


class AbortRequest(_Request):
    rid: str = ""
    abort_all: bool = False


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with (and only with) type "json_schema"')
        return self

    def as_json_schema(self) -> str | None:
        """The SamplingParams json_schema this format asks for (None: free text)."""
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.json_schema is not None:
            return json.dumps(self.json_schema.schema_)
        return None


class _OpenAISampling(_Request):
    """Fields shared by completions and chat (OpenAI's, then SGLang's extras)."""

    model: str
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, Any] | None = None
    # SGLang extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    rid: str | None = None
    priority: int | None = None  # --enable-priority-scheduling
    # structured output
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None

    def sampling_dict(self, max_new_tokens: int | None) -> dict[str, Any]:
        """The SamplingParams keyword arguments this request sets (None = default)."""
        pairs = {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "min_new_tokens": self.min_tokens,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "seed": self.seed,
            "logit_bias": self.logit_bias,
            "n": self.n,
            "json_schema": self.response_format and self.response_format.as_json_schema(),
            "regex": self.regex,
            "ebnf": self.ebnf,
        }
        return {k: v for k, v in pairs.items() if v is not None}


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = DEFAULT_COMPLETION_TOKENS  # null means the default, as in OpenAI
    echo: bool = False
    logprobs: int | None = None

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any) -> Any:
        return DEFAULT_COMPLETION_TOKENS if value is None else value


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: calls it made (chat_request.py)
    tool_call_id: str | None = None  # tool: the call this message answers
    # assistant: its reasoning, for templates that render it (gpt-oss's analysis channel)
    reasoning_content: str | None = None


# ---------------------------------------------------------------------- tools (requests)
class ToolFunction(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: ToolFunction


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # tool calls and reasoning (server/chat_request.py)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True  # SGLang's: reasoning_content apart from content


# ---------------------------------------------------------------------- responses
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None  # omitted when None

    @model_serializer(mode="wrap")
    def _omit_absent_details(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("prompt_tokens_details") is None:
            data.pop("prompt_tokens_details", None)
        return data


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------- tool calls (responses)
class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of a call: the first carries id, type and name; later ones more of
    the arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


def error_body(message: str, status_code: int, param: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status_code < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status_code}}
