"""The detokenizer: token-id deltas in, UTF-8-safe text deltas out (and its process).

Per request, `IncrementalDecoder` keeps a window of ids and two offsets into it:

    ids[0:surr_offset]            already turned into committed text, no longer decoded
    ids[surr_offset:read_offset]  context: decoded only so the next word's spacing is right
    ids[read_offset:]             not yet committed: their text is decode(ids[surr:]) minus
                                  decode(ids[surr:read])

New text is committed (and the window slides) only when it does not end in U+FFFD, i.e.
never in the middle of a multi-byte character. The complete characters before a trailing
U+FFFD run are emitted early; `sent_len` remembers how much of the text the client has.
While unfinished, a tail that could be the start of a stop string is held back (when the
scheduler sends the request's stop strings). On finish, a matched stop string is cut (and a
matched stop token id dropped) unless `no_stop_trim`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from sglite.messages import AbortReq, BatchTextOutput, BatchTokenOutput, ReadyMsg

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"

DecodeFn = Callable[[Sequence[int], bool], str]  # (ids, skip_special_tokens) -> text


def stop_prefix_len(text: str, stop_strs: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stop_strs:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class IncrementalDecoder:
    """Turns one request's token-id deltas into text deltas (see the module docstring)."""

    def __init__(
        self,
        decode: DecodeFn,
        context_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        no_stop_trim: bool = False,
        stop_strs: Sequence[str] = (),
    ):
        self._decode = decode
        self.ids: list[int] = list(context_ids)
        self.surr_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # committed output text
        self.sent_len = 0  # characters of output text already emitted
        self.skip_special_tokens = skip_special_tokens
        self.no_stop_trim = no_stop_trim
        self.stop_strs = tuple(stop_strs)

    def _new_text(self, ids: Sequence[int]) -> str:
        prefix = self._decode(ids[self.surr_offset : self.read_offset], self.skip_special_tokens)
        full = self._decode(ids[self.surr_offset :], self.skip_special_tokens)
        return full[len(prefix) :]

    def step(self, new_ids: Sequence[int], finished_reason: dict[str, Any] | None = None) -> str:
        """Add `new_ids`; return the text the client has not seen yet and may see now."""
        self.ids.extend(new_ids)
        if finished_reason is not None:
            return self._finish(finished_reason)
        new = self._new_text(self.ids)
        if new and not new.endswith(REPLACEMENT_CHAR):
            self.text += new
            self.surr_offset, self.read_offset = self.read_offset, len(self.ids)
            visible = self.text
        else:
            visible = self.text + new.rstrip(REPLACEMENT_CHAR)
        if self.stop_strs and not self.no_stop_trim:
            visible = visible[: len(visible) - stop_prefix_len(visible, self.stop_strs)]
        return self._emit(visible)

    def _finish(self, reason: dict[str, Any]) -> str:
        ids = self.ids
        matched = reason.get("matched") if reason.get("type") == "stop" else None
        trim = not self.no_stop_trim
        if trim and isinstance(matched, int) and len(ids) > self.read_offset and ids[-1] == matched:
            ids = ids[:-1]
        final = self.text + self._new_text(ids)
        if trim and isinstance(matched, str) and matched:
            # The match overlaps the uncommitted text: an earlier occurrence (before
            # min_new_tokens allowed matching) is not the one that stopped the request.
            pos = final.find(matched, max(0, len(self.text) - len(matched) + 1))
            if pos < 0:
                pos = final.find(matched)
            if pos >= 0:
                final = final[:pos]
        if len(final) < self.sent_len:  # only without stop_strs: nothing was held back
            logger.debug(
                "part of a stop string was streamed (%d > %d chars)", self.sent_len, len(final)
            )
        self.text = final
        return self._emit(final)

    def _emit(self, visible: str) -> str:
        if len(visible) <= self.sent_len:
            return ""
        delta = visible[self.sent_len :]
        self.sent_len = len(visible)
        return delta


class DetokenizerManager:
    """Keeps one IncrementalDecoder per live request; BatchTokenOutput -> BatchTextOutput.

    A request whose text cannot be decoded is finished for the client (an abort with status
    500) and an exact AbortReq for it is queued: `take_aborts()` hands them to the process
    loop, which must send them before the text output, so that the rid is still taken when
    the scheduler learns of the abort. Until the scheduler's own finish for it arrives, the
    request's further outputs are dropped.
    """

    def __init__(self, decode: DecodeFn):
        self._decode = decode
        self.states: dict[str, IncrementalDecoder] = {}
        self.failed: set[str] = set()  # told the client, waiting for the scheduler's finish
        self._aborts: list[AbortReq] = []

    def take_aborts(self) -> list[AbortReq]:
        """The aborts queued since the last call, for the scheduler (via the tokenizer)."""
        aborts, self._aborts = self._aborts, []
        return aborts

    def handle(self, batch: BatchTokenOutput) -> BatchTextOutput:
        out = BatchTextOutput([], [], [], [], [], [], [])
        for i, rid in enumerate(batch.rids):
            reason = batch.finished_reasons[i]
            if rid in self.failed:  # the client already has its (abort) finish
                if reason is not None:
                    self.failed.discard(rid)
                continue
            text, reason = self._step(batch, i, reason)
            out.rids.append(rid)
            out.texts.append(text)
            out.output_ids.append(list(batch.output_ids[i]))
            out.finished_reasons.append(reason)
            out.prompt_tokens.append(batch.prompt_tokens[i])
            out.completion_tokens.append(batch.completion_tokens[i])
            out.cached_tokens.append(batch.cached_tokens[i])
            out.logprobs.append(batch.logprobs[i] if batch.logprobs else None)
        return out

    def _step(
        self, batch: BatchTokenOutput, i: int, reason: dict[str, Any] | None
    ) -> tuple[str, dict[str, Any] | None]:
        """Request i's text delta and the finish reason the client gets."""
        rid = batch.rids[i]
        state = self.states.get(rid)
        if state is None:
            state = self.states[rid] = IncrementalDecoder(
                self._decode,
                batch.context_ids[i],
                skip_special_tokens=batch.skip_special_tokens[i],
                no_stop_trim=batch.no_stop_trim[i],
                stop_strs=batch.stop_strs[i] if batch.stop_strs else (),
            )
        try:
            text = state.step(batch.output_ids[i], reason)
        except Exception as e:  # a bad id must not take the detokenizer down
            logger.exception("could not detokenize request %s", rid)
            text = ""
            if reason is None:  # the scheduler is still running it: stop it too
                message = f"detokenization failed: {e}"
                reason = {"type": "abort", "status_code": 500, "message": message}
                self._aborts.append(AbortReq(rid=rid, message=message, exact=True))
                self.failed.add(rid)
        if reason is not None:
            del self.states[rid]
        return text, reason


def make_decode_fn(tokenizer: Any) -> DecodeFn:
    """A DecodeFn over a Hugging Face tokenizer (no clean-up: it breaks incremental text)."""

    def decode(ids: Sequence[int], skip_special_tokens: bool) -> str:
        return tokenizer.decode(
            list(ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    return decode


def run_detokenizer_process(server_args: Any, ipc: Any, ready_conn: Any) -> None:
    """Process entry: bind PULL at ipc.detokenizer, push text to ipc.tokenizer, forever."""
    import zmq

    from sglite.ipc import Receiver, Sender
    from sglite.server.tokenizer import tokenizer_for

    try:
        tokenizer = tokenizer_for(server_args)
        ctx = zmq.Context()
        receiver = Receiver(ctx, ipc.detokenizer, bind=True)
        sender = Sender(ctx, ipc.tokenizer)
        manager = DetokenizerManager(make_decode_fn(tokenizer))
    except Exception as e:
        ready_conn.send(ReadyMsg.failed("detokenizer", e))
        return
    ready_conn.send(ReadyMsg("detokenizer", ok=True))
    while True:
        msg = receiver.recv()
        if isinstance(msg, BatchTokenOutput):
            out = manager.handle(msg)
            for abort in manager.take_aborts():
                sender.send(abort)
        else:  # control replies routed through us are forwarded unchanged
            out = msg
        sender.send(out)
