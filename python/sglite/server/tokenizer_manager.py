"""TokenizerManager: sends validated requests to the scheduler and tracks their outputs.

It lives in the main process, on the asyncio loop of the HTTP server (or of the offline
Engine's thread). Every request is checked once, by `self.inputs` (server/inputs.py), before
anything is sent: a bad one raises `RequestError` (HTTP 400 with a message naming the
field); an overloaded or dying server raises it with 503. Each sent request has a
`ReqState` (server/req_state.py) that the receive loop fills from the detokenizer's BatchTextOutput; callers wait
on the event shared by the requests they submitted together. A caller that goes away
(client disconnect, cancelled task) aborts its unfinished requests, each by its exact id: a
prefix abort (SGLang's /abort_request) would also hit every request whose id extends it.
The detokenizer, which has no socket to the scheduler, asks for aborts through us: an
AbortReq that arrives on the receive socket is forwarded to the scheduler. CPU work of the
HTTP routes (parsing, templating, tokenizing) runs in `offload`'s threads (--tokenizer-threads),
so the loop stays free; HF fast tokenizers release the GIL while they encode. With --dp-size N
the scheduler is N replicas behind `self.dispatcher` (server/dp_dispatcher.py): a request
goes to one, aborts and control requests to all, and their stats come back merged.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq
import zmq.asyncio

from sglite.ipc import AsyncReceiver, IpcNames
from sglite.messages import (
    AbortReq,
    BatchTextOutput,
    GenerateReq,
)
from sglite.scheduler.watchdog import Heartbeat, stall_threshold
from sglite.server.control_requests import CONTROL_REPLIES, ControlRequests
from sglite.server.dp_dispatcher import Dispatcher
from sglite.server.errors import QueueFullError, RequestError
from sglite.server.inputs import InputProcessor, Prompt
from sglite.server.limits import RequestLimits
from sglite.server.logprob_format import LogprobLists, TokenTexts
from sglite.server.metrics import create_metrics
from sglite.server.req_state import ReqState, raise_if_failed
from sglite.server.request_log import create_request_log

logger = logging.getLogger(__name__)

SEND_RETRY_S = 2.0  # the scheduler's connection may still be settling right after start-up


class TokenizerManager(ControlRequests):
    """The main process's side of the scheduler/detokenizer pipeline (see module doc)."""

    def __init__(
        self,
        server_args: Any,
        model_info: dict[str, Any],
        tokenizer: Any,
        ipc: IpcNames,
        *,
        max_queued_requests: int | None = None,
        heartbeat: Heartbeat | None = None,
        limits: RequestLimits | None = None,
    ):
        """`limits`: what one request may ask for (the HTTP server's; none by default)."""
        self.server_args = server_args
        self.model_info = model_info
        self.tokenizer = tokenizer
        self.ipc = ipc
        self.context_length = int(model_info["context_length"])
        self.vocab_size = int(model_info["vocab_size"])
        self.max_total_tokens = model_info.get("max_total_tokens")
        self.served_model_name = server_args.served_model_name or server_args.model_path
        # at this many waiting requests a new one gets 503 (None: no limit)
        self.max_queued_requests = max_queued_requests or getattr(
            server_args, "max_queued_requests", None
        )
        self.cache_report = bool(getattr(server_args, "enable_cache_report", False))
        self.metrics = create_metrics(
            getattr(server_args, "enable_metrics", False), self.served_model_name
        )
        self.request_log = create_request_log(
            getattr(server_args, "log_requests", False),
            getattr(server_args, "log_requests_level", 0),
        )
        self.states: dict[str, ReqState] = {}
        self.inputs = InputProcessor.for_server(
            tokenizer, server_args, model_info, lambda r: r not in self.states, limits
        )
        self._pool = ThreadPoolExecutor(
            getattr(server_args, "tokenizer_threads", 4), thread_name_prefix="sglite-tokenize"
        )
        self.dead_reason: str | None = None  # set when a child process died
        self.heartbeat = heartbeat or Heartbeat()  # when the scheduler's current step began
        self.dispatcher = Dispatcher.for_server(ipc, server_args, self.max_total_tokens)
        self.dp_size = self.dispatcher.num_replicas
        # one queue per (reply type, replica): each replica answers in the order it was asked
        self._waiters: dict[tuple[type, int], deque[asyncio.Future]] = {
            (kind, rank): deque() for kind in CONTROL_REPLIES for rank in range(self.dp_size)
        }
        self.token_texts = TokenTexts(tokenizer)  # log-prob entries' token texts
        self._recv_task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Bind the sockets and start the receive loop (on the running event loop)."""
        self.loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context.shadow(self._ctx)
        self.dispatcher.bind(self._ctx)
        self._receiver = AsyncReceiver(self._actx, self.ipc.tokenizer, bind=True)
        self._recv_task = asyncio.create_task(self._recv_loop(), name="sglite-recv")

    async def offload(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in a tokenizer thread (CPU work that must not block the loop)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._recv_task is not None:
            self._recv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._recv_task
            self._recv_task = None
            self.dispatcher.close()
            self._receiver.close()
            self._ctx.term()

    def health_problem(self) -> str | None:
        """Why the server is unhealthy (a dead child, a stuck scheduler step), or None.

        An idle scheduler is healthy; a step running longer than
        `stall_threshold(--watchdog-timeout)` is a stall, whatever the watchdog does later."""
        if self.dead_reason is not None:
            return self.dead_reason
        stalled_s = self.heartbeat.busy_for(time.monotonic())
        threshold = stall_threshold(self.server_args.watchdog_timeout)
        if stalled_s >= threshold:
            return (
                f"the scheduler has made no progress for {stalled_s:.0f} s (one step has been "
                f"running longer than {threshold:g} s)"
            )
        return None

    def fail_all(self, reason: str) -> None:
        """A child process died: finish every waiting request with a 503."""
        self.dead_reason = reason
        for rid in list(self.states):
            self._finish_here(rid, {"type": "abort", "message": reason, "status_code": 503})

    def _finish_here(self, rid: str, reason: dict[str, Any]) -> None:
        """Finish a request without waiting for the scheduler (whose late output is ignored)."""
        state = self.states.pop(rid)
        self.dispatcher.done(rid)
        state.finished_reason = reason
        state.version += 1
        state.notify.set()
        self.request_log.on_finish(state, time.perf_counter())

    # ------------------------------------------------------------------ receiving
    async def _recv_loop(self) -> None:
        while True:
            msg = await self._receiver.recv()
            try:
                if isinstance(msg, BatchTextOutput):
                    self._on_text(msg)
                elif isinstance(msg, AbortReq):  # from the detokenizer, for the scheduler
                    with contextlib.suppress(zmq.Again):
                        self._send(msg)
                elif (type(msg), getattr(msg, "dp_rank", 0)) in self._waiters:
                    queue = self._waiters[(type(msg), msg.dp_rank)]
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
            delta = out.logprobs[i] if out.logprobs else None
            if delta is not None and state.logprobs is not None:
                state.logprobs.add(delta)
            if new_ids:
                # Every request's first token is sent as soon as it exists, streamed or not;
                # a non-streamed request's other tokens then arrive together at its finish.
                first = state.first_output is None
                ttft = now - state.created if first else None
                since = None if first else now - state.last_output
                self.metrics.on_tokens(len(new_ids), since, ttft)
                state.first_output = state.first_output or now
                state.last_output = now
            state.version += 1
            reason = out.finished_reasons[i]
            if reason is not None:
                state.finished_reason = reason
                self.metrics.on_finish(state.prompt_len, now - state.created)
                self.request_log.on_finish(state, now)
                del self.states[rid]
                self.dispatcher.done(rid)
            state.notify.set()

    # ------------------------------------------------------------------ generation
    def _send(self, msg: Any) -> None:
        """Best effort, no waiting: a replica that cannot be reached is skipped."""
        self.dispatcher.send(msg)

    def _send_to(self, rank: int, msg: Any) -> None:
        self.dispatcher.send_to(rank, msg)

    async def _send_retrying(self, msg: Any) -> None:
        for rank in self.dispatcher.targets(msg):
            deadline = time.monotonic() + SEND_RETRY_S
            while True:
                try:
                    self._send_to(rank, msg)
                    break
                except zmq.Again:
                    if time.monotonic() > deadline:
                        raise RequestError("the scheduler is not reachable", 503) from None
                    await asyncio.sleep(0.01)

    @property
    def num_waiting(self) -> int:
        """Requests sent to the scheduler that have no output token yet (queued, or in their
        first prefill): what --max-queued-requests limits."""
        return sum(1 for s in self.states.values() if s.first_output is None)

    async def submit(self, prompts: Sequence[Prompt], stream: bool) -> list[ReqState]:
        """Send `prompts` (one submission: a batch is refused or accepted as a whole, and
        never for its own size) and return their states."""
        if self.dead_reason is not None:
            raise RequestError(f"the server is shutting down: {self.dead_reason}", 503)
        limit = self.max_queued_requests
        if limit is not None and self.num_waiting >= limit:
            raise QueueFullError(
                f"the server is overloaded: {self.num_waiting} requests are waiting "
                f"(--max-queued-requests {limit}); retry in {QueueFullError.retry_after_s} s",
                503,
            )
        taken = next((p.rid for p in prompts if p.rid in self.states), None)
        if taken is not None:  # prepared in a thread: another request may have taken it since
            raise RequestError(f"rid: {taken!r} is not a free request id", param="rid")
        notify = asyncio.Event()
        states = []
        for p in prompts:
            state = ReqState(p.rid, len(p.input_ids), stream, notify, prompt_text=p.input_text)
            state.sampling_params = p.sampling_params
            if p.logprob is not None:
                state.logprobs = LogprobLists(p.logprob, self.token_texts)
            self.states[p.rid] = state
            states.append(state)
        try:
            for p in prompts:
                await self._send_retrying(
                    GenerateReq(
                        p.rid,
                        p.input_ids,
                        p.sampling_params,
                        stream=stream,
                        input_text=p.input_text,
                        logprob=p.logprob,
                        priority=p.priority,
                    )
                )
        except BaseException:
            for state in states:
                self._abort_one(state.rid, "the request could not be submitted")
            raise
        return states

    async def run(
        self,
        prompts: Sequence[Prompt],
        *,
        stream: bool,
        is_disconnected: Callable[[], Awaitable[bool]] | None = None,
    ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """submit() then follow()."""
        states = await self.submit(prompts, stream)
        async for item in self.follow(states, stream=stream, is_disconnected=is_disconnected):
            yield item

    async def follow(
        self,
        states: list[ReqState],
        *,
        stream: bool,
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
                    self._abort_one(s.rid)

    async def collect(
        self,
        prompts: Sequence[Prompt],
        is_disconnected: Callable[[], Awaitable[bool]] | None = None,
    ) -> list[dict[str, Any]]:
        """Run to completion: the final output of each prompt, in order. A request the
        scheduler refused (an abort with an HTTP status) raises RequestError."""
        outputs: list[dict[str, Any]] = [{} for _ in prompts]
        async for i, out in self.run(prompts, stream=False, is_disconnected=is_disconnected):
            outputs[i] = out
        for out in outputs:
            raise_if_failed(out)
        return outputs

    async def _wait(
        self, event: asyncio.Event, is_disconnected: Callable[[], Awaitable[bool]] | None
    ) -> None:
        if is_disconnected is None:
            await event.wait()
            return
        while True:
            try:
                await asyncio.wait_for(event.wait(), timeout=1.0)
                return
            except TimeoutError:
                if await is_disconnected():  # `finally` in follow() aborts the requests
                    raise RequestError("the client disconnected", 499) from None

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort by id prefix (or all): finish their waiters now, tell the scheduler."""
        for key in list(self.states):
            if abort_all or (rid and key.startswith(rid)):
                self._finish_here(key, {"type": "abort", "message": "aborted"})
        with contextlib.suppress(zmq.Again):
            self._send(AbortReq(rid=rid, abort_all=abort_all))

    def _abort_one(self, rid: str, message: str = "aborted by the client") -> None:
        """Abort exactly this request (never the others whose id starts with `rid`)."""
        if rid in self.states:
            self._finish_here(rid, {"type": "abort", "message": "aborted"})
        with contextlib.suppress(zmq.Again):
            self._send(AbortReq(rid=rid, message=message, exact=True))
