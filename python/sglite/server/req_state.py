"""ReqState: one request's outputs as the main process collects them, and the dicts
clients get (`snapshot`: text, output ids and `meta_info`, SGLang's /generate shape)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from sglite.sampling_params import SamplingParams
from sglite.server.inputs import RequestError
from sglite.server.logprob_format import LogprobLists


@dataclass
class ReqState:
    rid: str
    prompt_len: int
    stream: bool
    notify: asyncio.Event  # shared by the requests submitted together
    created: float = field(default_factory=time.perf_counter)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict[str, Any] | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    version: int = 0  # bumped on every output
    first_output: float | None = None
    last_output: float | None = None
    logprobs: LogprobLists | None = None  # return_logprob
    prompt_text: str | None = None  # for --log-requests
    sampling_params: SamplingParams | None = None

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
        if self.logprobs is not None:
            meta.update(self.logprobs.meta())
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


def raise_if_failed(output: dict[str, Any]) -> None:
    """An abort that carries an HTTP status (refused or failed request) -> RequestError."""
    reason = output["meta_info"]["finish_reason"] or {}
    if reason.get("type") == "abort" and reason.get("status_code"):
        raise RequestError(str(reason.get("message", "aborted")), int(reason["status_code"]))
