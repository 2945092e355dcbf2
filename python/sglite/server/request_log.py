"""`--log-requests`: one log line per finished request, at `--log-requests-level` detail.

Every line has the request id, prompt / output / cached token counts, time to first token,
end-to-end latency and the finish reason. Level 1 adds the sampling parameters that differ
from the defaults; level 2 the first and last characters of the prompt and output
(`TEXT_EDGE` each); level 3 the full prompt and output. Prompt text only appears from level
2 on, so the default line never holds user data. Text is JSON-quoted so one request stays
one line. Without `--log-requests` the TokenizerManager holds a `NullRequestLog`.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

from sglite.sampling_params import SamplingParams

logger = logging.getLogger("sglite.requests")

TEXT_EDGE = 100
_DEFAULTS = SamplingParams().to_dict()


class FinishedRequest(Protocol):
    """What the TokenizerManager knows about a request when it finishes (its ReqState)."""

    rid: str
    prompt_len: int
    completion_tokens: int
    cached_tokens: int
    text: str
    created: float
    first_output: float | None
    finished_reason: dict[str, Any] | None
    prompt_text: str | None
    sampling_params: SamplingParams | None


class NullRequestLog:
    def on_finish(self, req: FinishedRequest, now: float) -> None:
        pass


class RequestLog(NullRequestLog):
    def __init__(self, level: int):
        self.level = level

    def on_finish(self, req: FinishedRequest, now: float) -> None:
        logger.info("%s", self.line(req, now))

    def line(self, req: FinishedRequest, now: float) -> str:
        ttft = req.first_output - req.created if req.first_output is not None else None
        parts = [
            f"rid={req.rid}",
            f"prompt_tokens={req.prompt_len}",
            f"output_tokens={req.completion_tokens}",
            f"cached_tokens={req.cached_tokens}",
            f"ttft={ttft:.3f}s" if ttft is not None else "ttft=-",
            f"latency={now - req.created:.3f}s",
            f"finish={_compact(req.finished_reason)}",
        ]
        if self.level >= 1 and req.sampling_params is not None:
            changed = {
                k: v for k, v in req.sampling_params.to_dict().items() if v != _DEFAULTS.get(k)
            }
            parts.append(f"sampling={_compact(changed)}")
        if self.level >= 2:
            full = self.level >= 3
            if req.prompt_text is not None:
                parts.append(f"prompt={_quote(req.prompt_text, full)}")
            parts.append(f"output={_quote(req.text, full)}")
        return "request " + " ".join(parts)


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def _quote(text: str, full: bool) -> str:
    if not full and len(text) > 2 * TEXT_EDGE:
        omitted = len(text) - 2 * TEXT_EDGE
        text = f"{text[:TEXT_EDGE]}...({omitted} characters)...{text[-TEXT_EDGE:]}"
    return json.dumps(text, ensure_ascii=False)


def create_request_log(enabled: bool, level: int) -> NullRequestLog:
    return RequestLog(level) if enabled else NullRequestLog()
