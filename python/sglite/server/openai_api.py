"""The OpenAI-compatible endpoints: /v1/completions and /v1/chat/completions.

Each handler validates the body into Prompts through the TokenizerManager, then either
collects the final outputs into one response or streams chunks (text deltas) as SSE.
Choice `index` = prompt index * n + sample index; usage counts each prompt once.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from sglite.server.inputs import Prompt, RequestError
from sglite.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    error_body,
)
from sglite.server.tokenizer_manager import TokenizerManager

IsDisconnected = Callable[[], Awaitable[bool]]


def finish_reason_name(reason: dict[str, Any] | None) -> str | None:
    return None if reason is None else str(reason.get("type"))


def matched_stop(reason: dict[str, Any] | None) -> int | str | None:
    return None if reason is None else reason.get("matched")


def check_model(tm: TokenizerManager, model: str) -> None:
    """Any value is accepted, as SGLang does: one server serves one model, and clients send
    "default", the Hub id or whatever their config holds (responses carry the served name)."""


def _usage(
    prompt_lens: list[int], outputs: list[dict[str, Any]], cache_report: bool = False
) -> UsageInfo:
    """Token counts; prefix-cache hits only with --enable-cache-report (SGLang's rule)."""
    prompt = sum(prompt_lens)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outputs)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details={"cached_tokens": cached} if cache_report else None,
    )


def _prompts_for(
    tm: TokenizerManager,
    req: CompletionRequest | ChatCompletionRequest,
    token_lists: list[tuple[list[int], str | None, str]],
    max_tokens: int | None,
    max_param: str = "max_tokens",
) -> tuple[list[Prompt], list[int]]:
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options: only allowed with stream=true", param="stream_options")
    prompts: list[Prompt] = []
    for i, (ids, text, param) in enumerate(token_lists):
        budget = max_tokens  # none given: as many as fit (OpenAI's chat default)
        if budget is None:
            budget = max(tm.inputs.max_new_tokens_limit(len(ids)), 0)
        sp, n = tm.inputs.sampling_params(req.sampling_dict(budget), param=None)
        rid = req.rid if req.rid is None or len(token_lists) == 1 else f"{req.rid}_{i}"
        prompts += tm.inputs.make_prompts(
            ids, sp, n, param=param, text=text, rid=rid, max_param=max_param
        )
    return prompts, [len(ids) for ids, _, _ in token_lists]


def completion_prompts(
    tm: TokenizerManager,
    req: CompletionRequest,
) -> tuple[list[Prompt], list[int]]:
    check_model(tm, req.model)
    if req.logprobs is not None:
        raise RequestError("logprobs: not supported by this server", param="logprobs")
    if req.echo:
        raise RequestError("echo: not supported by this server", param="echo")
    p = req.prompt
    if isinstance(p, str):
        items: list[Any] = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [p]
    else:
        items = list(p)
    if not items:
        raise RequestError("prompt: is an empty list", param="prompt")
    lists = []
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            lists.append((tm.inputs.tokenize(item, param), item, param))
        else:
            lists.append((tm.inputs.check_ids(item, param), None, param))
    return _prompts_for(tm, req, lists, req.max_tokens)


def _message_dict(m: Any, i: int) -> dict[str, Any]:
    content = m.content
    if isinstance(content, list):
        parts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(
                    f"messages[{i}].content: only text parts are supported", param="messages"
                )
            parts.append(part["text"])
        content = "".join(parts)
    return {"role": m.role, "content": content or ""}


def chat_prompts(
    tm: TokenizerManager,
    req: ChatCompletionRequest,
) -> tuple[list[Prompt], list[int]]:
    check_model(tm, req.model)
    if req.logprobs:
        raise RequestError("logprobs: not supported by this server", param="logprobs")
    if req.tools:
        raise RequestError("tools: tool calling is not supported by this server", param="tools")
    messages = [_message_dict(m, i) for i, m in enumerate(req.messages)]
    text, ids = tm.inputs.apply_chat_template(messages)
    if not ids:
        raise RequestError("messages: the conversation is empty", param="messages")
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(req, max_param)
    return _prompts_for(tm, req, [(ids, text, "messages")], max_tokens, max_param)


async def completions(
    tm: TokenizerManager, req: CompletionRequest, is_disconnected: IsDisconnected | None
) -> dict[str, Any]:
    prompts, lens = completion_prompts(tm, req)
    outputs = await tm.collect(prompts, is_disconnected)
    choices = [
        CompletionChoice(
            index=i,
            text=o["text"],
            finish_reason=finish_reason_name(o["meta_info"]["finish_reason"]),
            matched_stop=matched_stop(o["meta_info"]["finish_reason"]),
        )
        for i, o in enumerate(outputs)
    ]
    return CompletionResponse(
        model=tm.served_model_name, choices=choices, usage=_usage(lens, outputs, tm.cache_report)
    ).model_dump()


async def chat(
    tm: TokenizerManager, req: ChatCompletionRequest, is_disconnected: IsDisconnected | None
) -> dict[str, Any]:
    prompts, lens = chat_prompts(tm, req)
    outputs = await tm.collect(prompts, is_disconnected)
    choices = [
        ChatChoice(
            index=i,
            message=ChatMessageOut(content=o["text"]),
            finish_reason=finish_reason_name(o["meta_info"]["finish_reason"]),
            matched_stop=matched_stop(o["meta_info"]["finish_reason"]),
        )
        for i, o in enumerate(outputs)
    ]
    return ChatCompletionResponse(
        model=tm.served_model_name, choices=choices, usage=_usage(lens, outputs, tm.cache_report)
    ).model_dump()


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def stream_openai(
    tm: TokenizerManager, prompts: list[Prompt], lens: list[int], *, chat: bool, include_usage: bool
) -> AsyncIterator[str]:
    """Submit, then yield SSE events of text deltas; ends with `data: [DONE]`.

    Submission happens before the first yield so a refused request is an HTTP error."""
    states = await tm.submit(prompts, stream=True)
    return _stream_events(tm, states, lens, chat=chat, include_usage=include_usage)


async def _stream_events(
    tm: TokenizerManager, states: list[Any], lens: list[int], *, chat: bool, include_usage: bool
) -> AsyncIterator[str]:
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created, model = int(time.time()), tm.served_model_name
    sent = [0] * len(states)
    finals: list[dict[str, Any]] = [{} for _ in states]

    def chunk(i: int, text: str | None, reason: dict[str, Any] | None, first: bool) -> str:
        fr, ms = finish_reason_name(reason), matched_stop(reason)
        if chat:
            delta = ChatDelta(role="assistant" if first else None, content=text)
            c: Any = ChatCompletionChunk(
                id=rid,
                created=created,
                model=model,
                choices=[ChatStreamChoice(index=i, delta=delta, finish_reason=fr, matched_stop=ms)],
            )
        else:
            c = CompletionChunk(
                id=rid,
                created=created,
                model=model,
                choices=[
                    CompletionChoice(index=i, text=text or "", finish_reason=fr, matched_stop=ms)
                ],
            )
        return sse(c.model_dump(exclude_none=chat))

    try:
        if chat:
            for i in range(len(states)):
                yield chunk(i, "", None, True)
        async for i, out in tm.follow(states, stream=True):
            reason = out["meta_info"]["finish_reason"]
            if reason and reason.get("type") == "abort" and reason.get("status_code"):
                yield sse(error_body(str(reason.get("message")), int(reason["status_code"])))
                continue
            delta = out["text"][sent[i] :]
            sent[i] = len(out["text"])
            if delta or reason is not None:
                yield chunk(i, delta, reason, False)
            if reason is not None:
                finals[i] = out
        if include_usage and all(finals):
            usage = _usage(lens, finals, tm.cache_report)
            cls: Any = ChatCompletionChunk if chat else CompletionChunk
            yield sse(
                cls(id=rid, created=created, model=model, choices=[], usage=usage).model_dump(
                    exclude_none=True
                )
            )
        yield "data: [DONE]\n\n"
    except RequestError as e:
        yield sse(error_body(e.message, e.status_code, e.param))
        yield "data: [DONE]\n\n"
