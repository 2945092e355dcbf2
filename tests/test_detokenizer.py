"""The detokenizer: incremental text equals the full decode, never half a UTF-8 character,
stop strings and stop tokens trimmed (unless no_stop_trim), special tokens skipped."""

from __future__ import annotations

import multiprocessing as mp
import random

import pytest
import zmq

from fixtures.serving import build_tiny_tokenizer
from sglite.detokenizer import (
    DetokenizerManager,
    IncrementalDecoder,
    make_decode_fn,
    run_detokenizer_process,
    stop_prefix_len,
)
from sglite.ipc import IpcNames, Receiver, Sender
from sglite.messages import AbortReq, BatchTextOutput, BatchTokenOutput, FlushCacheResp

TEXTS = [
    "Hello world! How are you today?",
    "Emoji: 😀 🎉 🚀 👍🏽 ❤️ and 🤖.",
    "東京は日本の首都です。北京是中国的首都。",
    "mixed 東京 😀 text\n\nwith\ttabs 👍🏽 end",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def decode(tokenizer):
    return make_decode_fn(tokenizer)


def full(tokenizer, ids, skip=True):
    return tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def run_chunks(decode, ids, sizes, context=(), reason=None, **kw):
    dec = IncrementalDecoder(decode, context, **kw)
    deltas, pos = [], 0
    for n in sizes:
        chunk = ids[pos : pos + n]
        pos += n
        last = pos >= len(ids)
        deltas.append(dec.step(chunk, reason if last else None))
        if last:
            break
    return deltas


def test_tokenizer_splits_characters_across_tokens(tokenizer):
    """The test is only meaningful if some tokens hold part of a character."""
    ids = tokenizer.encode(TEXTS[1])
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", range(4))
def test_incremental_equals_full_decode(tokenizer, decode, text, seed):
    rng = random.Random(seed)
    ids = tokenizer.encode(text)
    sizes = [rng.choice([1, 1, 1, 2, 3]) for _ in ids]
    deltas = run_chunks(decode, ids, sizes, reason={"type": "length", "length": len(ids)})
    assert "".join(deltas) == full(tokenizer, ids) == text
    for d in deltas:  # no delta ends inside a character
        assert "\ufffd" not in d


def test_unfinished_stream_never_emits_replacement_chars(tokenizer, decode):
    ids = tokenizer.encode(TEXTS[1] + TEXTS[2])
    dec = IncrementalDecoder(decode)
    out = "".join(dec.step([i]) for i in ids)
    assert "\ufffd" not in out
    assert (TEXTS[1] + TEXTS[2]).startswith(out)
    assert len(out) >= len(TEXTS[1] + TEXTS[2]) - 2


def test_context_ids_fix_spacing_but_are_not_emitted(tokenizer, decode):
    prompt = tokenizer.encode("The capital of France is")
    out = tokenizer.encode(" Paris. The capital")
    deltas = run_chunks(
        decode,
        out,
        [1] * len(out),
        context=prompt[-5:],
        reason={"type": "length", "length": len(out)},
    )
    assert "".join(deltas) == " Paris. The capital"


def _until_stop(tokenizer, text, stop):
    """The ids up to the token that completes `stop` (where the scheduler finishes)."""
    ids = tokenizer.encode(text)
    k = next(k for k in range(len(ids)) if stop in full(tokenizer, ids[: k + 1]))
    return ids[: k + 1]


def test_stop_string_trimmed_when_finished_in_one_output(tokenizer, decode):
    """Non-streaming: the scheduler sends everything with the finish."""
    ids = _until_stop(tokenizer, "Hello world! STOP here", "STOP")
    reason = {"type": "stop", "matched": "STOP"}
    assert IncrementalDecoder(decode).step(ids, reason) == "Hello world! "
    kept = IncrementalDecoder(decode, no_stop_trim=True).step(ids, reason)
    assert kept == full(tokenizer, ids) and kept.startswith("Hello world! STOP")


@pytest.mark.parametrize("stop", ["STOP", "\n\n", "! S"])
def test_stop_string_trimmed_when_streamed(tokenizer, decode, stop):
    text = "Hello world! STOP here\n\nmore"
    ids = _until_stop(tokenizer, text, stop)
    reason = {"type": "stop", "matched": stop}
    streamed = run_chunks(decode, ids, [1] * len(ids), reason=reason, stop_strs=[stop, "zzz"])
    assert "".join(streamed) == text[: text.index(stop)]
    kept = run_chunks(
        decode, ids, [1] * len(ids), reason=reason, stop_strs=[stop], no_stop_trim=True
    )
    assert "".join(kept) == full(tokenizer, ids)


def test_stop_string_trim_ignores_occurrence_before_min_tokens(tokenizer, decode):
    """A stop string seen before min_new_tokens allowed matching is kept."""
    first = tokenizer.encode("END a b c ")
    last = tokenizer.encode("END tail")
    dec = IncrementalDecoder(decode)
    text = "".join(dec.step([i]) for i in first)
    text += dec.step(last, {"type": "stop", "matched": "END"})
    assert text == "END a b c "


def test_stop_prefix_held_back_while_streaming(tokenizer, decode):
    ids = tokenizer.encode("Hello world! STOP")
    dec = IncrementalDecoder(decode, stop_strs=["STOP"])
    seen = ""
    for i in ids[:-1]:
        seen += dec.step([i])
        assert "ST" not in seen
    seen += dec.step(ids[-1:], {"type": "stop", "matched": "STOP"})
    assert seen == "Hello world! "


def test_stop_prefix_len():
    assert stop_prefix_len("abc\n", ["\n\n"]) == 1
    assert stop_prefix_len("xaa", ["aab"]) == 2
    assert stop_prefix_len("hello", ["xyz"]) == 0
    assert stop_prefix_len("STO", ["STOP", "TOPS"]) == 3


def test_matched_stop_token_dropped(tokenizer, decode):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Hi there") + [eos]
    reason = {"type": "stop", "matched": eos}
    shown = run_chunks(decode, ids, [1] * len(ids), reason=reason, skip_special_tokens=False)
    assert "".join(shown) == "Hi there"
    kept = run_chunks(
        decode, ids, [1] * len(ids), reason=reason, skip_special_tokens=False, no_stop_trim=True
    )
    assert "".join(kept) == "Hi there<|im_end|>"


def test_skip_special_tokens(tokenizer, decode):
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = [start] + tokenizer.encode("assistant\nHi") + [start]
    reason = {"type": "length", "length": len(ids)}
    assert "".join(run_chunks(decode, ids, [1] * len(ids), reason=reason)) == "assistant\nHi"
    raw = run_chunks(decode, ids, [1] * len(ids), reason=reason, skip_special_tokens=False)
    assert "".join(raw) == "<|im_start|>assistant\nHi<|im_start|>"


def _batch(rids, outs, ctx, reasons, **kw):
    n = len(rids)
    return BatchTokenOutput(
        rids,
        outs,
        ctx,
        reasons,
        [3] * n,
        [len(o) for o in outs],
        [0] * n,
        kw.get("skip", [True] * n),
        kw.get("no_trim", [False] * n),
    )


def test_manager_uses_stop_strs_when_the_scheduler_sends_them(tokenizer, decode):
    ids = _until_stop(tokenizer, "Hello world! STOP", "STOP")
    mgr = DetokenizerManager(decode)
    text = ""
    for k, i in enumerate(ids):
        last = k == len(ids) - 1
        batch = _batch(["r"], [[i]], [[]], [{"type": "stop", "matched": "STOP"} if last else None])
        batch.stop_strs = [["STOP"]] if k == 0 else [[]]  # optional field, first output only
        text += mgr.handle(batch).texts[0]
        assert "ST" not in text
    assert text == "Hello world! "


def test_manager_tracks_requests_independently(tokenizer, decode):
    a, b = tokenizer.encode(TEXTS[1]), tokenizer.encode(TEXTS[2])
    mgr = DetokenizerManager(decode)
    texts = {"a": "", "b": ""}
    for k in range(max(len(a), len(b))):
        rids, outs, reasons = [], [], []
        for rid, ids in (("a", a), ("b", b)):
            if k < len(ids):
                rids.append(rid)
                outs.append([ids[k]])
                reasons.append(
                    {"type": "length", "length": len(ids)} if k == len(ids) - 1 else None
                )
        out = mgr.handle(_batch(rids, outs, [[] for _ in rids], reasons))
        assert isinstance(out, BatchTextOutput) and out.rids == rids
        for rid, t in zip(out.rids, out.texts):
            texts[rid] += t
    assert texts == {"a": TEXTS[1], "b": TEXTS[2]}
    assert mgr.states == {}


BAD_ID = 10**6  # not in the tiny vocabulary


def _failing_decode(decode):
    """`decode`, except that it raises on BAD_ID (as a tokenizer may on an unknown id)."""

    def fn(ids, skip):
        if BAD_ID in ids:
            raise ValueError(f"unknown token id {BAD_ID}")
        return decode(ids, skip)

    return fn


def test_manager_aborts_exactly_the_request_it_cannot_decode(tokenizer, decode):
    """The client of the failed request gets an abort finish, the scheduler gets an exact
    AbortReq for that rid only; the others (one whose rid extends it) are untouched."""
    ids = tokenizer.encode(TEXTS[0])
    mgr = DetokenizerManager(_failing_decode(decode))
    rids = ["a", "ab", "b"]
    texts = dict.fromkeys(rids, "")
    out = mgr.handle(_batch(rids, [ids[:2]] * 3, [[]] * 3, [None] * 3))
    for rid, t in zip(out.rids, out.texts):
        texts[rid] += t
    assert mgr.take_aborts() == []

    out = mgr.handle(_batch(rids, [[BAD_ID], ids[2:4], ids[2:4]], [[]] * 3, [None] * 3))
    assert out.rids == rids
    reason = out.finished_reasons[0]
    assert reason["type"] == "abort" and reason["status_code"] == 500
    assert "detokenization failed" in reason["message"] and str(BAD_ID) in reason["message"]
    assert out.texts[0] == "" and out.finished_reasons[1:] == [None, None]
    assert mgr.take_aborts() == [AbortReq(rid="a", message=reason["message"], exact=True)]
    assert mgr.take_aborts() == []  # handed over once
    texts["ab"] += out.texts[1]
    texts["b"] += out.texts[2]

    # Until the scheduler's finish for "a" arrives, its outputs are dropped (no second
    # abort, no second finish for the client); the others run to completion.
    length = {"type": "length", "length": len(ids)}
    out = mgr.handle(_batch(rids, [[BAD_ID], ids[4:], ids[4:]], [[]] * 3, [None, length, None]))
    assert out.rids == ["ab", "b"] and out.finished_reasons == [length, None]
    texts["ab"] += out.texts[0]
    texts["b"] += out.texts[1]
    abort = {"type": "abort", "message": "detokenization failed", "status_code": 499}
    out = mgr.handle(_batch(["a", "b"], [[], []], [[], []], [abort, length]))
    assert out.rids == ["b"] and out.finished_reasons == [length]
    texts["b"] += out.texts[0]
    assert mgr.take_aborts() == []
    assert texts["ab"] == texts["b"] == TEXTS[0]
    assert mgr.states == {} and mgr.failed == set()


def test_manager_failure_on_the_last_output_sends_no_abort(tokenizer, decode):
    """The scheduler already finished the request: the client gets its finish, nothing is
    sent to the scheduler."""
    mgr = DetokenizerManager(_failing_decode(decode))
    length = {"type": "length", "length": 1}
    out = mgr.handle(_batch(["a"], [[BAD_ID]], [[]], [length]))
    assert out.finished_reasons == [length] and out.texts == [""]
    assert mgr.take_aborts() == [] and mgr.states == {} and mgr.failed == set()


def test_detokenizer_process_over_zmq(tokenizer, tmp_path):
    from sglite.config import ServerArgs

    path = build_tiny_tokenizer(tmp_path / "tok")
    ipc = IpcNames.allocate()
    ctx = zmq.Context()
    inbox = Receiver(ctx, ipc.tokenizer, bind=True)
    sender = Sender(ctx, ipc.detokenizer)
    spawn = mp.get_context("spawn")
    parent_conn, child_conn = spawn.Pipe(duplex=False)
    proc = spawn.Process(
        target=run_detokenizer_process,
        daemon=True,
        args=(ServerArgs(model_path=str(path)), ipc, child_conn),
    )
    proc.start()
    try:
        assert parent_conn.poll(60), "the detokenizer did not report readiness"
        assert parent_conn.recv().ok
        ids = tokenizer.encode(TEXTS[3])
        for k, i in enumerate(ids):
            last = k == len(ids) - 1
            sender.send(
                _batch(
                    ["r"], [[i]], [[]], [{"type": "length", "length": len(ids)} if last else None]
                )
            )
        text = ""
        while True:
            msg = inbox.recv(timeout_ms=10_000)
            assert msg is not None, "no output from the detokenizer"
            text += msg.texts[0]
            if msg.finished_reasons[0] is not None:
                break
        assert text == TEXTS[3]
        # An id the tokenizer rejects: the abort for the scheduler goes out before the
        # client's finish (so the rid cannot be reused in between).
        sender.send(_batch(["x", "xy"], [[-1], ids[:2]], [[], []], [None, None]))
        abort = inbox.recv(timeout_ms=10_000)
        assert isinstance(abort, AbortReq) and (abort.rid, abort.exact) == ("x", True)
        msg = inbox.recv(timeout_ms=10_000)
        assert isinstance(msg, BatchTextOutput) and msg.rids == ["x", "xy"]
        assert msg.finished_reasons[0]["status_code"] == 500 and msg.finished_reasons[1] is None
        sender.send(FlushCacheResp(True))
        assert isinstance(inbox.recv(timeout_ms=10_000), FlushCacheResp)  # forwarded as is
    finally:
        proc.terminate()
        proc.join(10)
        inbox.close()
        sender.close()
        ipc.cleanup()
