"""TokenizerManager aborts, over its real ZMQ sockets with the test playing the scheduler and
the detokenizer: a caller that goes away aborts exactly its own request (never the ones whose
rid extends it), and an AbortReq from the detokenizer is forwarded to the scheduler."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from sglite.ipc import AsyncReceiver, IpcNames, Sender
from sglite.messages import AbortReq, BatchTextOutput, GenerateReq
from sglite.sampling_params import SamplingParams
from sglite.server.inputs import Prompt
from sglite.server.tokenizer_manager import TokenizerManager

RECV_TIMEOUT_S = 30  # only bounds a failing test; nothing waits for it to pass


class _Args:
    served_model_name = "m"
    model_path = "m"
    page_size = 1


def _manager(ipc: IpcNames | None = None) -> TokenizerManager:
    info = {"context_length": 64, "vocab_size": 100}
    return TokenizerManager(_Args(), info, None, ipc)


def _prompt(rid: str) -> Prompt:
    return Prompt(rid, [1, 2, 3], SamplingParams(max_new_tokens=4))


def _finish(rid: str, reason: dict[str, Any]) -> BatchTextOutput:
    return BatchTextOutput([rid], ["xy"], [[7, 8]], [reason], [3], [2], [0])


@contextlib.asynccontextmanager
async def _wired() -> AsyncIterator[tuple[TokenizerManager, AsyncReceiver, Sender]]:
    """A started manager, the scheduler's end of its output and the detokenizer's input."""
    ipc = IpcNames.allocate()
    tm = _manager(ipc)
    await tm.start()
    ctx = zmq.asyncio.Context()
    scheduler = AsyncReceiver(ctx, ipc.scheduler_input)
    detokenizer = Sender(ctx, ipc.tokenizer)
    try:
        yield tm, scheduler, detokenizer
    finally:
        scheduler.close()
        detokenizer.close()
        ctx.term()
        await tm.close()
        ipc.cleanup()


async def _recv(sock: AsyncReceiver) -> Any:
    return await asyncio.wait_for(sock.recv(), RECV_TIMEOUT_S)


async def _follow_to_end(tm: TokenizerManager, states: list) -> list[dict[str, Any]]:
    return [out async for _, out in tm.follow(states, stream=True)]


def test_cancelled_caller_aborts_exactly_its_request():
    async def main() -> None:
        async with _wired() as (tm, scheduler, detokenizer):
            [a] = await tm.submit([_prompt("a")], stream=True)
            [ab] = await tm.submit([_prompt("ab")], stream=True)
            assert [(await _recv(scheduler)).rid for _ in range(2)] == ["a", "ab"]
            follow_a = asyncio.create_task(_follow_to_end(tm, [a]))
            follow_ab = asyncio.create_task(_follow_to_end(tm, [ab]))
            await asyncio.sleep(0)  # both followers are waiting now
            follow_a.cancel()
            with pytest.raises(asyncio.CancelledError):
                await follow_a
            abort = await _recv(scheduler)
            assert abort == AbortReq(rid="a", message="aborted by the client", exact=True)
            assert a.finished_reason["type"] == "abort"
            assert not ab.finished and "ab" in tm.states
            length = {"type": "length", "length": 2}
            detokenizer.send(_finish("ab", length))
            outs = await asyncio.wait_for(follow_ab, RECV_TIMEOUT_S)
            assert outs[-1]["meta_info"]["finish_reason"] == length
            assert outs[-1]["text"] == "xy" and tm.states == {}

    asyncio.run(main())


def test_forwards_detokenizer_abort_to_scheduler():
    async def main() -> None:
        async with _wired() as (tm, scheduler, detokenizer):
            [a] = await tm.submit([_prompt("a")], stream=False)
            assert isinstance(await _recv(scheduler), GenerateReq)  # connected now
            abort = AbortReq(rid="a", message="detokenization failed: bad id", exact=True)
            detokenizer.send(abort)
            assert await _recv(scheduler) == abort
            # The client is finished by the detokenizer's text output, not by the abort.
            assert not a.finished
            failed = {"type": "abort", "status_code": 500, "message": abort.message}
            detokenizer.send(_finish("a", failed))
            outs = await asyncio.wait_for(_follow_to_end(tm, [a]), RECV_TIMEOUT_S)
            assert outs[-1]["meta_info"]["finish_reason"] == failed

    asyncio.run(main())


def test_submit_failure_aborts_each_request_exactly():
    sent: list[Any] = []

    def send(msg: Any) -> None:
        if isinstance(msg, GenerateReq) and msg.rid == "ab":
            raise RuntimeError("socket closed")
        sent.append(msg)

    tm = _manager()
    tm._send = send
    tm._send_to = lambda rank, msg: send(msg)
    with pytest.raises(RuntimeError, match="socket closed"):
        asyncio.run(tm.submit([_prompt("a"), _prompt("ab")], stream=False))
    assert [type(m).__name__ for m in sent] == ["GenerateReq", "AbortReq", "AbortReq"]
    assert [(m.rid, m.exact, m.abort_all) for m in sent[1:]] == [
        ("a", True, False),
        ("ab", True, False),
    ]
    assert tm.states == {}
