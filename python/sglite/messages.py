"""Every record that crosses a process boundary, and the one codec that carries them.

Flow: TokenizerManager --(GenerateReq, AbortReq, FlushCacheReq, GetStatsReq)--> Scheduler
      Scheduler --(BatchTokenOutput)--> Detokenizer --(BatchTextOutput)--> TokenizerManager
      Scheduler --(FlushCacheResp, StatsResp)--> TokenizerManager (straight, no detokenizer).
With --dp-size N there are N schedulers; a GenerateReq goes to one, the other requests to
all, and each control reply says which replica sent it (`dp_rank`).

Finish reasons are plain dicts, as in the HTTP API:
  {"type": "stop", "matched": <token id or stop string>}   (matched None: EOS without id)
      a structured-output request stops so once its grammar accepted EOS (matched: that id);
      matched None also when its grammar refused the sampled token (dropped from the output)
  {"type": "length", "length": N}
  {"type": "abort", "message": "...", "status_code": 400|503|...}
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from sglite.logprobs import LogprobOptions, TokenLogprob
from sglite.sampling_params import SamplingParams


@dataclass
class GenerateReq:
    """A tokenized, validated generation request."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    extra_key: str | None = None
    input_text: str | None = None
    logprob: LogprobOptions | None = None  # return_logprob: what to compute
    priority: int | None = None  # --enable-priority-scheduling; None: 0


@dataclass
class LogprobDelta:
    """A request's log-prob entries not sent before: prompt positions, then output tokens."""

    input: list[TokenLogprob]
    output: list[TokenLogprob]


@dataclass
class AbortReq:
    """Abort every request whose id starts with `rid` (SGLang's /abort_request), all when
    `abort_all`, or only the request whose id is exactly `rid` when `exact` (a client that
    disconnected, a request the detokenizer failed on)."""

    rid: str = ""
    abort_all: bool = False
    message: str = "aborted by the client"
    exact: bool = False


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheResp:
    success: bool
    message: str = ""
    dp_rank: int = 0  # the replying data-parallel replica (--dp-size)


@dataclass
class GetStatsReq:
    pass


@dataclass
class StatsResp:
    """Scheduler state for /get_server_info and /metrics."""

    stats: dict[str, Any]
    dp_rank: int = 0  # the replying data-parallel replica (--dp-size)


@dataclass
class BatchTokenOutput:
    """Token-id deltas of one scheduler step, one entry per request that has news.

    `context_ids[i]` is non-empty only in a request's first output: the last few prompt
    tokens, decoded for context (so the first word's spacing is right) but never emitted.
    `output_ids[i]` are the new token ids since the last output for that request.
    """

    rids: list[str]
    output_ids: list[list[int]]
    context_ids: list[list[int]]
    finished_reasons: list[dict[str, Any] | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    skip_special_tokens: list[bool]
    no_stop_trim: list[bool]
    # a request's stop strings, in its first output only: the detokenizer holds back any
    # streamed tail that could still become one of them
    stop_strs: list[list[str]] = field(default_factory=list)
    logprobs: list[LogprobDelta | None] = field(default_factory=list)


@dataclass
class BatchTextOutput:
    """Text deltas of one step, produced by the detokenizer for the TokenizerManager."""

    rids: list[str]
    texts: list[str]
    output_ids: list[list[int]]
    finished_reasons: list[dict[str, Any] | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    logprobs: list[LogprobDelta | None] = field(default_factory=list)


# What a child raises to refuse its input at start-up (a model, config field, GGUF or flag
# sglite does not support; a missing file): the message is the whole story. Any other
# exception is a bug, and its traceback is worth showing.
REFUSALS = (ValueError, OSError, NotImplementedError, ImportError)


@dataclass
class ReadyMsg:
    """Sent once by a child process when it is ready (or failed) at start-up. A failure
    carries `error` (one line for a refusal, see REFUSALS; "Type: message" otherwise) and
    the child's `traceback`, which the launcher logs at debug level for refusals."""

    process: str
    ok: bool
    error: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    traceback: str = ""
    refusal: bool = False

    @classmethod
    def failed(cls, process: str, exc: BaseException) -> ReadyMsg:
        import traceback

        refusal = isinstance(exc, REFUSALS)
        error = str(exc) if refusal and str(exc) else f"{type(exc).__name__}: {exc}"
        tb = "".join(traceback.format_exception(exc))
        return cls(process, False, error, traceback=tb, refusal=refusal)


def encode(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    return pickle.loads(data)
