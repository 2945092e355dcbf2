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

from sglite.logprobs import LogprobOptions
from sglite.server.chat_request import plan_chat
from sglite.server.chat_response import ChoiceReader, reader_for
from sglite.server.inputs import Prompt, RequestError
from sglite.server.logprob_format import openai_logprobs, openai_options
from sglite.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
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


def check_limits(
    tm: TokenizerManager, req: CompletionRequest | ChatCompletionRequest, num_prompts: int
) -> None:
    """The request limits that need no tokens (server/limits.py), before any tokenization."""
    tm.inputs.limits.check_sequences(num_prompts * max(req.n, 1))
    tm.inputs.limits.check_sampling(req.sampling_dict(None), None)


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
    logprob: LogprobOptions | None = None,
    extra_sampling: dict[str, Any] | None = None,
) -> tuple[list[Prompt], list[int]]:
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options: only allowed with stream=true", param="stream_options")
    prompts: list[Prompt] = []
    for i, (ids, text, param) in enumerate(token_lists):
        budget = max_tokens  # none given: as many as fit (OpenAI's chat default)
        if budget is None:
            budget = max(tm.inputs.max_new_tokens_limit(len(ids)), 0)
        sampling = req.sampling_dict(budget)
        clash = sorted(set(sampling) & set(extra_sampling or {}))
        if clash:  # e.g. a json_schema from both tool_choice and the request
            raise RequestError(
                f"tool_choice: a forced tool call and the request's {', '.join(clash)} both "
                "constrain the output; give only one of them",
                param="tool_choice",
            )
        sp, n = tm.inputs.sampling_params({**sampling, **(extra_sampling or {})}, param=None)
        rid = req.rid if req.rid is None or len(token_lists) == 1 else f"{req.rid}_{i}"
        prompts += tm.inputs.make_prompts(
            ids, sp, n, param=param, text=text, rid=rid, max_param=max_param, logprob=logprob
        )
    for p in prompts:
        p.priority = req.priority
    return prompts, [len(ids) for ids, _, _ in token_lists]


def completion_prompts(
    tm: TokenizerManager,
    req: CompletionRequest,
) -> tuple[list[Prompt], list[int]]:
    check_model(tm, req.model)
    p = req.prompt
    if isinstance(p, str):
        items: list[Any] = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [p]
    else:
        items = list(p)
    if not items:
        raise RequestError("prompt: is an empty list", param="prompt")
    check_limits(tm, req, len(items))
    lists = []
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            lists.append((tm.inputs.tokenize(item, param), item, param))
        else:
            lists.append((tm.inputs.check_ids(item, param), None, param))
    logprob = openai_options(req.logprobs, None, echo=req.echo)
    return _prompts_for(tm, req, lists, req.max_tokens, logprob=logprob)


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
    out = {"role": m.role, "content": content or ""}
    if m.reasoning_content is not None:
        if m.role != "assistant":
            raise RequestError(
                f"messages[{i}].reasoning_content: only assistant messages have reasoning",
                param="messages",
            )
        out["reasoning_content"] = m.reasoning_content
    return out


def chat_prompts(
    tm: TokenizerManager,
    req: ChatCompletionRequest,
) -> tuple[list[Prompt], list[int]]:
    check_model(tm, req.model)
    check_limits(tm, req, 1)
    messages = [_message_dict(m, i) for i, m in enumerate(req.messages)]
    # tools, tool_choice, template kwargs, reasoning: server/chat_request.py
    plan = plan_chat(
        req,
        messages,
        tool_call_parser=getattr(tm.server_args, "tool_call_parser", None),
        reasoning_parser=getattr(tm.server_args, "reasoning_parser", None),
    )
    text, ids = tm.inputs.apply_chat_template(
        plan.messages, plan.template_tools, plan.template_kwargs
    )
    if not ids:
        raise RequestError("messages: the conversation is empty", param="messages")
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(req, max_param)
    logprob = openai_options(req.logprobs, req.top_logprobs)
    prompts, lens = _prompts_for(
        tm,
        req,
        [(ids, text, "messages")],
        max_tokens,
        max_param,
        logprob=logprob,
        extra_sampling=plan.sampling,
    )
    for p in prompts:
        p.chat_output = plan
    return prompts, lens


async def completions(
    tm: TokenizerManager,
    req: CompletionRequest,
    is_disconnected: IsDisconnected | None,
    prepared: tuple[list[Prompt], list[int]] | None = None,
) -> dict[str, Any]:
    """`prepared`: completion_prompts(tm, req), when the caller made them (off the loop)."""
    prompts, lens = prepared or completion_prompts(tm, req)
    outputs = await tm.collect(prompts, is_disconnected)
    choices = [
        CompletionChoice(
            index=i,
            text=(echo_text(tm, prompts[i]) if req.echo else "") + o["text"],
            logprobs=(
                openai_logprobs(o["meta_info"], chat=False, echo=req.echo)
                if req.logprobs is not None
                else None
            ),
            finish_reason=finish_reason_name(o["meta_info"]["finish_reason"]),
            matched_stop=matched_stop(o["meta_info"]["finish_reason"]),
        )
        for i, o in enumerate(outputs)
    ]
    return CompletionResponse(
        model=tm.served_model_name, choices=choices, usage=_usage(lens, outputs, tm.cache_report)
    ).model_dump()


async def chat(
    tm: TokenizerManager,
    req: ChatCompletionRequest,
    is_disconnected: IsDisconnected | None,
    prepared: tuple[list[Prompt], list[int]] | None = None,
) -> dict[str, Any]:
    """`prepared`: chat_prompts(tm, req), when the caller made them (off the loop)."""
    prompts, lens = prepared or chat_prompts(tm, req)
    outputs = await tm.collect(prompts, is_disconnected)
    choices = []
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        # content, reasoning_content, tool_calls: server/chat_response.py
        reader = reader_for(p.chat_output, p.input_text)
        message, reason, matched = reader.message(o["text"], o["meta_info"]["finish_reason"])
        logprobs = openai_logprobs(o["meta_info"], chat=True) if req.logprobs else None
        choices.append(
            ChatChoice(
                index=i,
                message=message,
                logprobs=logprobs,
                finish_reason=reason,
                matched_stop=matched,
            )
        )
    return ChatCompletionResponse(
        model=tm.served_model_name, choices=choices, usage=_usage(lens, outputs, tm.cache_report)
    ).model_dump()


def echo_text(tm: TokenizerManager, prompt: Prompt) -> str:
    """The prompt as `echo` returns it: the text sent, or the decoded token ids."""
    if prompt.input_text is not None:
        return prompt.input_text
    return tm.tokenizer.decode(prompt.input_ids, skip_special_tokens=False)


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def stream_openai(
    tm: TokenizerManager,
    prompts: list[Prompt],
    lens: list[int],
    req: CompletionRequest | ChatCompletionRequest,
    *,
    chat: bool,
) -> AsyncIterator[str]:
    """Submit, then yield SSE events of text deltas; ends with `data: [DONE]`.

    Submission happens before the first yield so a refused request is an HTTP error."""
    states = await tm.submit(prompts, stream=True)
    readers = [reader_for(p.chat_output, p.input_text) for p in prompts] if chat else None
    return _stream_events(tm, states, prompts, lens, req, chat=chat, readers=readers)


async def _stream_events(
    tm: TokenizerManager,
    states: list[Any],
    prompts: list[Prompt],
    lens: list[int],
    req: CompletionRequest | ChatCompletionRequest,
    *,
    chat: bool,
    readers: list[ChoiceReader] | None = None,
) -> AsyncIterator[str]:
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created, model = int(time.time()), tm.served_model_name
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    want_logprobs = bool(req.logprobs) if chat else req.logprobs is not None
    echo = not chat and req.echo
    sent = [0] * len(states)
    sent_logprobs = [0] * len(states)  # output log-prob entries already streamed
    started = [False] * len(states)
    finals: list[dict[str, Any]] = [{} for _ in states]

    def chunk(
        i: int,
        text: str | None,
        reason: dict[str, Any] | None,
        first: bool,
        logprobs: dict[str, Any] | None = None,
    ) -> str:
        fr, ms = finish_reason_name(reason), matched_stop(reason)
        if chat:
            delta = ChatDelta(role="assistant" if first else None, content=text)
            c: Any = ChatCompletionChunk(
                id=rid,
                created=created,
                model=model,
                choices=[
                    ChatStreamChoice(
                        index=i, delta=delta, logprobs=logprobs, finish_reason=fr, matched_stop=ms
                    )
                ],
            )
        else:
            c = CompletionChunk(
                id=rid,
                created=created,
                model=model,
                choices=[
                    CompletionChoice(
                        index=i,
                        text=text or "",
                        logprobs=logprobs,
                        finish_reason=fr,
                        matched_stop=ms,
                    )
                ],
            )
        return sse(c.model_dump(exclude_none=chat))

    def logprobs_delta(i: int, meta: dict[str, Any], with_prompt: bool) -> dict[str, Any] | None:
        if not want_logprobs:
            return None
        new = len(meta["output_token_logprobs"]) - sent_logprobs[i]
        if not (new or with_prompt):
            return None
        out = openai_logprobs(meta, chat=chat, echo=with_prompt, skip_output=sent_logprobs[i])
        sent_logprobs[i] += new
        return out

    def chat_chunk(
        i: int,
        delta: ChatDelta,
        fr: str | None,
        ms: int | str | None,
        logprobs: dict[str, Any] | None = None,
    ) -> str:
        choice = ChatStreamChoice(
            index=i, delta=delta, logprobs=logprobs, finish_reason=fr, matched_stop=ms
        )
        c = ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])
        return sse(c.model_dump(exclude_none=True))

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
            with_prompt = echo and not started[i]  # echo: the prompt comes first
            if with_prompt:
                delta = echo_text(tm, prompts[i]) + delta
            started[i] = True
            logprobs = logprobs_delta(i, out["meta_info"], with_prompt)
            if readers is not None:  # chat: content, reasoning, tool calls (chat_response.py)
                pieces = list(readers[i].step(delta, reason))
                if logprobs and not pieces:  # the text is held back; its log-probs are not
                    pieces = [(ChatDelta(), None, None)]
                for j, (d, fr, ms) in enumerate(pieces):
                    yield chat_chunk(i, d, fr, ms, logprobs if j == 0 else None)
            elif delta or reason is not None or logprobs:
                yield chunk(i, delta, reason, False, logprobs)
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
