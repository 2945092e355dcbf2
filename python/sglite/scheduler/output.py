"""OutputStreamer: turns processed requests into BatchTokenOutput messages (token-id deltas).

A finished request is emitted exactly once (with everything not yet sent); every request
is emitted on its first token (the server's time to first token, and its count of waiting
requests, rely on it, streamed or not); then a streaming request every `stream_interval`
tokens, a non-streaming one only when it finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from sglite.messages import BatchTokenOutput, LogprobDelta
from sglite.scheduler.req import Req

CONTEXT_TOKENS = 5  # prompt tokens sent once as detokenization context


class OutputStreamer:
    def __init__(self, send: Callable[[object], None], stream_interval: int = 1):
        self.send = send
        self.stream_interval = stream_interval

    def stream(self, reqs: Iterable[Req]) -> None:
        out = BatchTokenOutput([], [], [], [], [], [], [], [], [])
        for req in reqs:
            if req.finish_sent:
                continue
            new = len(req.output_ids) - req.sent_len
            if req.finished:
                pass
            elif new <= 0:
                continue
            elif req.first_output_sent and (not req.stream or new < self.stream_interval):
                continue
            self._append(out, req)
        if out.rids:
            self.send(out)

    def _append(self, out: BatchTokenOutput, req: Req) -> None:
        out.rids.append(req.rid)
        out.output_ids.append(req.output_ids[req.sent_len :])
        out.context_ids.append([] if req.first_output_sent else req.input_ids[-CONTEXT_TOKENS:])
        reason = req.finished_reason
        out.finished_reasons.append(dict(reason) if reason else None)
        out.prompt_tokens.append(len(req.input_ids))
        out.completion_tokens.append(len(req.output_ids))
        out.cached_tokens.append(req.cached_tokens)
        out.skip_special_tokens.append(req.sampling_params.skip_special_tokens)
        out.no_stop_trim.append(req.sampling_params.no_stop_trim)
        out.stop_strs.append([] if req.first_output_sent else list(req.sampling_params.stop_strs))
        out.logprobs.append(_logprob_delta(req) if req.logprob is not None else None)
        req.sent_len = len(req.output_ids)
        req.first_output_sent = True
        req.finish_sent = reason is not None


def _logprob_delta(req: Req) -> LogprobDelta:
    delta = LogprobDelta(
        req.input_logprobs[req.sent_input_logprobs :],
        req.output_logprobs[req.sent_output_logprobs :],
    )
    req.sent_input_logprobs = len(req.input_logprobs)
    req.sent_output_logprobs = len(req.output_logprobs)
    return delta
