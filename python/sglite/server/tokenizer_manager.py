"""TokenizerManager: validates and tokenizes requests, sends them, and tracks their outputs.

It lives in the main process, on the asyncio loop of the HTTP server (or of the offline
Engine's thread). Every request is checked here, once, before anything is sent: a bad one
raises `RequestError` (HTTP 400 with a message naming the field), an overloaded server
raises it with 503. Each sent request has a `ReqState` that the receive loop fills from the
detokenizer's BatchTextOutput; callers wait on the state's group event. A caller that goes
away (client disconnect, cancelled task) aborts its unfinished requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import zmq
import zmq.asyncio

from sglite.ipc import AsyncReceiver, IpcNames, Sender
from sglite.messages import (
    AbortReq,
    BatchTextOutput,
    FlushCacheReq,
    FlushCacheResp,
    GenerateReq,
    GetStatsReq,
    StatsResp,
)
from sglite.sampling_params import SamplingParams
from sglite.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

MAX_INFLIGHT_REQUESTS = 1024  # beyond this a new request gets 503 instead of queueing forever
MAX_N = 128
CONTROL_TIMEOUT_S = 10.0
SEND_RETRY_S = 2.0  # the scheduler's connection may still be settling right after start-up


class RequestError(ValueError):
    """A request the server refuses; `status_code` is the HTTP status to answer with."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param


@dataclass
class Prompt:
    """One validated sequence to generate, ready to send."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    input_text: str | None = None


@dataclass
class ReqState:
    rid: str
    prompt_len: int
    notify: asyncio.Event
    created: float = field(default_factory=time.perf_counter)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict[str, Any] | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    version: int = 0  # bumped on every output
    first_output: float | None = None
    last_output: float | None = None

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def snapshot(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finished_reason,
            "prompt_tokens": self.prompt_len,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }
        if self.finished:
            meta["e2e_latency"] = (self.last_output or time.perf_counter()) - self.created
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


class TokenizerManager:
    """The main process's side of the scheduler/detokenizer pipeline (see module doc)."""

    def __init__(self, server_args: Any, model_info: dict[str, Any], tokenizer: Any,
                 ipc: IpcNames, *, max_inflight: int = MAX_INFLIGHT_REQUESTS):
        self.server_args = server_args
        self.model_info = model_info
        self.tokenizer = tokenizer
        self.ipc = ipc
        self.context_length = int(model_info["context_length"])
        self.vocab_size = int(model_info["vocab_size"])
        self.max_total_tokens = model_info.get("max_total_tokens")
        self.served_model_name = server_args.served_model_name or server_args.model_path
        self.max_inflight = max_inflight
        self.metrics = ServerMetrics(self.served_model_name)
        self.states: dict[str, ReqState] = {}
        self.dead_reason: str | None = None  # set when a child process died
        self._waiters: dict[type, deque[asyncio.Future]] = {
            FlushCacheResp: deque(), StatsResp: deque()}
        self._recv_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Bind the sockets and start the receive loop (on the running event loop)."""
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context.shadow(self._ctx)
        self._sender = Sender(self._ctx, self.ipc.scheduler_input, bind=True)
        self._receiver = AsyncReceiver(self._actx, self.ipc.tokenizer, bind=True)
        self._recv_task = asyncio.create_task(self._recv_loop(), name="sglite-recv")

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._recv_task
            self._recv_task = None
            self._sender.close()
            self._receiver.close()

    def fail_all(self, reason: str) -> None:
        """A child process died: finish every waiting request with a 503."""
        self.dead_reason = reason
        for rid in list(self.states):
            self._finish_here(rid, {"type": "abort", "message": reason, "status_code": 503})

    def _finish_here(self, rid: str, reason: dict[str, Any]) -> None:
        """Finish a request without waiting for the scheduler (whose late output is ignored)."""
        state = self.states.pop(rid)
        state.finished_reason = reason
        state.version += 1
        state.notify.set()

    # ------------------------------------------------------------------ receiving
    async def _recv_loop(self) -> None:
        while True:
            msg = await self._receiver.recv()
            try:
                if isinstance(msg, BatchTextOutput):
                    self._on_text(msg)
                elif type(msg) in self._waiters:
                    queue = self._waiters[type(msg)]
                    if queue:
                        fut = queue.popleft()
                        if not fut.done():
                            fut.set_result(msg)
                else:
                    logger.warning("unexpected message %s", type(msg).__name__)
            except Exception:  # one bad message must not stop the server
                logger.exception("error while handling %s", type(msg).__name__)

    def _on_text(self, out: BatchTextOutput) -> None:
        now = time.perf_counter()
        for i, rid in enumerate(out.rids):
            state = self.states.get(rid)
            if state is None:  # aborted by us, or a health check that timed out
                continue
            new_ids = out.output_ids[i]
            state.text += out.texts[i]
            state.output_ids.extend(new_ids)
            state.completion_tokens = out.completion_tokens[i]
            state.cached_tokens = out.cached_tokens[i]
            ttft = None if state.first_output is not None or not new_ids else now - state.created
            since = None if state.last_output is None else now - state.last_output
            if new_ids:
                if state.first_output is None:
                    state.first_output = now
                self.metrics.on_tokens(len(new_ids), since, ttft)
            state.last_output = now
            state.version += 1
            reason = out.finished_reasons[i]
            if reason is not None:
                state.finished_reason = reason
                self.metrics.on_finish(state.prompt_len, now - state.created)
                del self.states[rid]
            state.notify.set()

    # ------------------------------------------------------------------ validation
    def tokenize(self, text: Any, param: str) -> list[int]:
        if not isinstance(text, str):
            raise RequestError(f"{param} must be a string, got {type(text).__name__}", param=param)
        if not text:
            raise RequestError(f"{param} is empty; give a non-empty prompt", param=param)
        return list(self.tokenizer.encode(text))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("messages: this model has no chat template; use /v1/completions",
                               param="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja errors: unsupported role order, ...
            raise RequestError(f"messages: the chat template rejected them ({e})",
                               param="messages") from e
        return text, list(self.tokenizer.encode(text, add_special_tokens=False))

    def check_ids(self, ids: Any, param: str) -> list[int]:
        if not isinstance(ids, list) or not ids:
            raise RequestError(f"{param} must be a non-empty list of token ids", param=param)
        for j, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise RequestError(f"{param}[{j}] = {t!r} is not a token id in "
                                   f"[0, {self.vocab_size})", param=param)
        return ids

    def sampling_params(self, data: Any, param: str = "sampling_params") -> tuple[SamplingParams, int]:
        """Build SamplingParams (and the `n` of parallel sampling) from a request dict."""
        if data is not None and not isinstance(data, dict):
            raise RequestError(f"{param} must be an object", param=param)
        data = dict(data or {})
        n = data.pop("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
            raise RequestError(f"n must be an integer in [1, {MAX_N}], got {n!r}", param="n")
        if isinstance(data.get("stop"), str):
            data["stop"] = [data["stop"]]
        try:
            sp = SamplingParams.from_dict(data)
            sp.check_vocab(self.vocab_size)
        except (ValueError, TypeError) as e:
            raise RequestError(f"{param}: {e}", param=param) from e
        return sp, n

    def check_length(self, prompt_len: int, sp: SamplingParams, param: str) -> None:
        ctx = self.context_length
        if prompt_len >= ctx:
            raise RequestError(f"{param}: the prompt has {prompt_len} tokens; the model's "
                               f"context length is {ctx} tokens (prompt and output together)",
                               param=param)
        if prompt_len + sp.max_new_tokens > ctx:
            raise RequestError(
                f"max_new_tokens: the prompt ({prompt_len} tokens) plus max_new_tokens "
                f"({sp.max_new_tokens}) is more than the model's context length ({ctx} "
                f"tokens); ask for at most {ctx - prompt_len} new tokens", param="max_new_tokens")
        cap = self.max_total_tokens
        if cap is not None and prompt_len + 1 > cap:
            raise RequestError(f"{param}: the prompt has {prompt_len} tokens but the KV cache "
                               f"holds only {cap}", param=param)

    def make_prompts(self, ids: list[int], sp: SamplingParams, n: int, *, param: str,
                     text: str | None = None, rid: str | None = None) -> list[Prompt]:
        """n validated copies of one prompt (distinct seeds when a seed is given)."""
        self.check_length(len(ids), sp, param)
        if rid is not None and (rid in self.states or not isinstance(rid, str) or not rid):
            raise RequestError(f"rid: {rid!r} is not a free request id", param="rid")
        base = rid or uuid.uuid4().hex
        out = []
        for i in range(n):
            sp_i = sp if i == 0 or sp.seed is None else replace(sp, seed=sp.seed + i)
            out.append(Prompt(base if n == 1 else f"{base}_{i}", ids, sp_i, text))
        return out

    def prepare_generate(self, text: Any = None, input_ids: Any = None,
                         sampling_params: Any = None, rid: Any = None,
                         ) -> tuple[list[Prompt], bool]:
        """Validate a native /generate (or Engine.generate) call: (prompts, is_batch)."""
        if (text is None) == (input_ids is None):
            raise RequestError("exactly one of text and input_ids must be given", param="text")
        if text is not None:
            is_batch = isinstance(text, list)
            items = text if is_batch else [text]
            param = "text"
        else:
            is_batch = isinstance(input_ids, list) and bool(input_ids) and all(
                isinstance(x, list) for x in input_ids)
            items = input_ids if is_batch else [input_ids]
            param = "input_ids"
        if not items:
            raise RequestError(f"{param} is an empty batch", param=param)
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        rids = rid if isinstance(rid, list) else [rid] * len(items)
        if len(sps) != len(items) or len(rids) != len(items) or (rid is not None and is_batch
                                                                 and not isinstance(rid, list)):
            raise RequestError(f"sampling_params and rid must be lists as long as {param} "
                               "(or a single value for all)", param="sampling_params")
        prompts: list[Prompt] = []
        for i, (item, sp_dict, r) in enumerate(zip(items, sps, rids)):
            where = f"{param}[{i}]" if is_batch else param
            ids = self.tokenize(item, where) if text is not None else self.check_ids(item, where)
            sp, n = self.sampling_params(sp_dict)
            is_batch = is_batch or n > 1
            prompts += self.make_prompts(ids, sp, n, param=where, rid=r,
                                         text=item if text is not None else None)
        if len({p.rid for p in prompts}) != len(prompts):
            raise RequestError("rid: request ids must be unique", param="rid")
        return prompts, is_batch

    # ------------------------------------------------------------------ generation
    def _send(self, msg: Any) -> None:
        self._sender.send(msg)

    async def _send_retrying(self, msg: Any) -> None:
        deadline = time.monotonic() + SEND_RETRY_S
        while True:
            try:
                return self._send(msg)
            except zmq.Again:
                if time.monotonic() > deadline:
                    raise RequestError("the scheduler is not reachable", 503) from None
                await asyncio.sleep(0.01)

    async def submit(self, prompts: Sequence[Prompt], stream: bool) -> list[ReqState]:
        if self.dead_reason is not None:
            raise RequestError(f"the server is shutting down: {self.dead_reason}", 503)
        if len(self.states) + len(prompts) > self.max_inflight:
            raise RequestError(f"the server is overloaded ({len(self.states)} requests in "
                               f"flight, limit {self.max_inflight}); retry later", 503)
        notify = asyncio.Event()
        states = []
        for p in prompts:
            state = ReqState(p.rid, len(p.input_ids), notify)
            self.states[p.rid] = state
            states.append(state)
            await self._send_retrying(GenerateReq(p.rid, p.input_ids, p.sampling_params,
                                                  stream=stream, input_text=p.input_text))
        return states

    async def run(self, prompts: Sequence[Prompt], *, stream: bool,
                  is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                  ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """submit() then follow()."""
        states = await self.submit(prompts, stream)
        async for item in self.follow(states, stream=stream, is_disconnected=is_disconnected):
            yield item

    async def follow(self, states: list[ReqState], *, stream: bool,
                     is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                     ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Yield (index, cumulative output) as outputs arrive (only final outputs unless
        `stream`). Unfinished requests are aborted if the caller stops iterating."""
        seen = [0] * len(states)
        notify = states[0].notify
        try:
            while True:
                await self._wait(notify, is_disconnected)
                notify.clear()
                for i, s in enumerate(states):
                    if s.version != seen[i] and (stream or s.finished):
                        seen[i] = s.version
                        yield i, s.snapshot()
                if all(s.finished for s in states):
                    return
        finally:
            for s in states:
                if not s.finished:  # the caller went away
                    self.abort(s.rid)

    async def _wait(self, event: asyncio.Event,
                    is_disconnected: Callable[[], Awaitable[bool]] | None) -> None:
        if is_disconnected is None:
            await event.wait()
            return
        while True:
            try:
                await asyncio.wait_for(event.wait(), timeout=1.0)
                return
            except TimeoutError:
                if await is_disconnected():
                    raise asyncio.CancelledError("client disconnected") from None

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort by id prefix (or all): finish their waiters now, tell the scheduler."""
        for key in list(self.states):
            if abort_all or (rid and key.startswith(rid)):
                self._finish_here(key, {"type": "abort", "message": "aborted"})
        with contextlib.suppress(zmq.Again):
            self._send(AbortReq(rid=rid, abort_all=abort_all))

    # ------------------------------------------------------------------ control
    async def _control(self, req: Any, reply_type: type) -> Any:
        fut = asyncio.get_running_loop().create_future()
        self._waiters[reply_type].append(fut)
        try:
            await self._send_retrying(req)
            return await asyncio.wait_for(fut, CONTROL_TIMEOUT_S)
        except TimeoutError:
            raise RequestError("the scheduler did not answer in time", 503) from None

    async def get_stats(self) -> dict[str, Any]:
        resp = await self._control(GetStatsReq(), StatsResp)
        self.metrics.update_from_stats(resp.stats)
        return resp.stats

    async def flush_cache(self) -> FlushCacheResp:
        return await self._control(FlushCacheReq(), FlushCacheResp)
