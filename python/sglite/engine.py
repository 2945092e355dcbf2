"""The offline Engine: the server's scheduler and detokenizer processes, without HTTP.

    with sglite.Engine(model_path="...") as llm:
        out = llm.generate("The capital of France is", {"max_new_tokens": 8})
        print(out["text"])

`generate` takes SGLang's arguments and returns the same dicts as POST /generate (a list for
a list of prompts). The TokenizerManager runs on a private event loop in a daemon thread,
so the Engine also works where the caller already runs an event loop (notebooks). The
children are spawned, so a script must create the Engine under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

from sglite.config import ServerArgs
from sglite.launcher import (
    DETOKENIZER_ENTRY,
    SCHEDULER_ENTRY,
    Entry,
    death_reason,
    setup_logging,
    start_backend,
)
from sglite.server.req_state import raise_if_failed

logger = logging.getLogger(__name__)

_END = object()


class Engine:
    """Offline generation; keyword arguments are ServerArgs fields (the CLI flags)."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        scheduler_entry: Entry = SCHEDULER_ENTRY,
        detokenizer_entry: Entry = DETOKENIZER_ENTRY,
        **server_args: Any,
    ):
        from sglite.server.tokenizer_manager import TokenizerManager

        known = {f.name for f in dataclasses.fields(ServerArgs)}
        unknown = sorted(set(server_args) - known)
        if unknown:
            raise TypeError(
                f"Engine() got unknown argument(s) {', '.join(unknown)}; "
                "they must be ServerArgs fields (the CLI flags in snake_case)"
            )
        args = ServerArgs(model_path=model_path, **server_args)
        if args.node_rank > 0:
            raise ValueError(
                "node_rank > 0: the Engine runs on node 0; start node k's TP ranks with "
                "`python -m sglite.launch_server ... --node-rank k`"
            )
        setup_logging(args.log_level)
        self._closed = False
        self._backend = start_backend(
            args, scheduler_entry=scheduler_entry, detokenizer_entry=detokenizer_entry
        )
        try:
            self.server_args = self._backend.server_args
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._loop.run_forever, name="sglite-engine-loop", daemon=True
            )
            self._thread.start()
            self.tm = TokenizerManager(
                self.server_args, self._backend.info, self._backend.tokenizer, self._backend.ipc
            )
            self._call(self.tm.start())
        except BaseException:
            self._backend.shutdown()
            raise
        self._backend.procs.watch(self._on_death)
        atexit.register(self.shutdown)

    # ------------------------------------------------------------------ public API
    @property
    def tokenizer(self) -> Any:
        return self._backend.tokenizer

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        return_text_in_logprobs: bool = False,
    ) -> Any:
        """Generate for one prompt (a dict) or a list of prompts (a list of dicts).

        With `stream=True`, returns an iterator of cumulative dicts (a batch adds "index").
        The log-prob arguments are SGLang's; the log-probs come back in `meta_info`
        (see sglite/server/logprob_format.py)."""
        logprob = {
            "return_logprob": return_logprob,
            "logprob_start_len": logprob_start_len,
            "top_logprobs_num": top_logprobs_num,
            "token_ids_logprob": token_ids_logprob,
            "return_text_in_logprobs": return_text_in_logprobs,
        }
        if stream:
            return self.generate_stream(prompt, sampling_params, input_ids, rid=rid, **logprob)
        return self._call(self._generate(prompt, sampling_params, input_ids, rid, logprob))

    def generate_stream(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
        **logprob: Any,
    ) -> Iterator[dict[str, Any]]:
        """Iterate over partial results as they arrive; the last one per prompt is final.
        `logprob`: the log-prob keyword arguments of `generate`."""
        self._check_open()
        items: queue.Queue = queue.Queue()
        prompts, is_batch = self._call(
            self._prepare(prompt, sampling_params, input_ids, rid, logprob)
        )

        async def pump() -> None:
            try:
                async for i, out in self.tm.run(prompts, stream=True):
                    if is_batch:
                        out["index"] = i
                    items.put(out)
            except BaseException as e:  # noqa: BLE001 - handed to the consuming thread
                items.put(e)
            finally:
                items.put(_END)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := items.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                self._check_open()
                raise_if_failed(item)
                yield item
        finally:
            future.cancel()  # the consumer stopped early: abort the requests

    def shutdown(self) -> None:
        """Stop the child processes and remove the IPC files (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._loop.is_running():
                asyncio.run_coroutine_threadsafe(self.tm.close(), self._loop).result(5)
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(5)
        finally:
            self._backend.shutdown()
            atexit.unregister(self.shutdown)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ helpers
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the Engine is shut down")
        if self.tm.dead_reason is not None:
            raise RuntimeError(f"the Engine is unusable: {self.tm.dead_reason}")

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _prepare(
        self, prompt: Any, sampling_params: Any, input_ids: Any, rid: Any, logprob: Any
    ) -> Any:
        return self.tm.inputs.prepare_generate(prompt, input_ids, sampling_params, rid, logprob)

    async def _generate(
        self, prompt: Any, sampling_params: Any, input_ids: Any, rid: Any, logprob: Any
    ) -> Any:
        self._check_open()
        prompts, is_batch = self.tm.inputs.prepare_generate(
            prompt, input_ids, sampling_params, rid, logprob
        )
        outputs = await self.tm.collect(prompts)
        self._check_open()
        return outputs if is_batch else outputs[0]

    def _on_death(self, name: str, code: int | None) -> None:
        reason = death_reason(name, code, self.server_args)
        logger.error("%s; the Engine cannot generate any more", reason)
        self._loop.call_soon_threadsafe(self.tm.fail_all, reason)
