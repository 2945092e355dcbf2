"""Grammar compiles under limits (constrained/compile_process.py): they run in a child process,
a compile past its deadline or its memory cap is stopped (its process killed, the next compile
gets a fresh one) and is not cached, the compile thread is free again at once, and a compiled
grammar from the child masks exactly as one compiled in-process."""

from __future__ import annotations

import json
import os

import pytest
import torch

from fixtures.grammars import settle
from sglite.constrained import GrammarError, create_backend
from sglite.constrained.compile_process import CompileTimeout
from sglite.constrained.grammar_queue import GrammarQueue
from sglite.constrained.mask import unpack
from sglite.sampling_params import SamplingParams
from sglite.scheduler.req import Req

EOS = 2
VOCAB = 400
SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
# a grammar no machine compiles in a fraction of a second (xgrammar takes ~30 s and ~900 MB
# for 20,000 values on a 49k vocabulary)
HUGE_ENUM = json.dumps({"enum": [f"value_{i}_{'x' * 12}" for i in range(100_000)]})


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))


def isolated(tokenizer, timeout_s=60.0, max_memory_mb=1024):
    return create_backend(
        "xgrammar",
        tokenizer,
        VOCAB,
        [EOS],
        compile_timeout_s=timeout_s,
        compile_max_memory_mb=max_memory_mb,
    )


def allowed_after(backend, compiled, tokens: list[int]) -> set[int]:
    m = backend.matcher(compiled)
    for t in tokens:
        assert m.accept(t)
    bitmask = torch.zeros((1, (VOCAB + 31) // 32), dtype=torch.int32)
    m.fill_mask(bitmask, 0)
    return set(torch.nonzero(unpack(bitmask, VOCAB)[0]).flatten().tolist())


def is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_grammar_compiled_in_a_child_masks_as_one_compiled_in_process(tokenizer):
    child = isolated(tokenizer)
    local = create_backend("xgrammar", tokenizer, VOCAB, [EOS])  # no limits: in-process
    try:
        for key in (("json_schema", SCHEMA), ("regex", "(ab|cd)+e")):
            a, b = child.compile(key), local.compile(key)
            assert allowed_after(child, a, []) == allowed_after(local, b, [])
            assert child.compiled_bytes(a) > 0
        procs = child.compiles().all
        assert len(procs) == 1 and procs[0].num_started == 1  # one child, reused
        with pytest.raises(GrammarError, match="regex: invalid regex"):
            child.compile(("regex", "(unclosed"))
        assert procs[0].num_started == 1  # an invalid grammar does not cost the child
    finally:
        child.shutdown()


def test_a_compile_past_its_deadline_is_stopped_and_the_next_one_runs(tokenizer):
    backend = isolated(tokenizer, timeout_s=0.05)
    try:
        backend.compile(("regex", "a+"))  # start the child (not charged to any deadline)
        (proc,) = backend.compiles().all
        pid = proc.pid
        with pytest.raises(CompileTimeout, match="did not compile within 0.05 s.*stopped"):
            backend.compile(("json_schema", HUGE_ENUM))
        assert is_gone(pid) and proc.num_killed == 1  # no thread or process left compiling
        assert proc.num_started == 2 and proc.pid != pid  # the next child is starting
        assert backend.compile(("regex", "b+")) is not None
        assert proc.num_started == 2
    finally:
        backend.shutdown()
    assert proc.pid is None


def test_a_compile_past_its_memory_cap_is_refused_as_too_large(tokenizer):
    backend = isolated(tokenizer, timeout_s=120.0, max_memory_mb=16)
    try:
        with pytest.raises(GrammarError, match="too large.*--grammar-compile-max-memory-mb"):
            backend.compile(("json_schema", HUGE_ENUM))
        assert backend.compile(("regex", "a+")) is not None
    finally:
        backend.shutdown()


def test_the_queue_refuses_a_stopped_compile_with_503_and_does_not_cache_it(tokenizer):
    """The compile thread is free again at once: the next grammar (one thread) compiles."""
    backend = isolated(tokenizer, timeout_s=0.05)
    queue = GrammarQueue(backend, timeout_s=3600.0, num_threads=1)
    try:
        slow = Req("slow", [5], SamplingParams(json_schema=HUGE_ENUM))
        fast = Req("fast", [5], SamplingParams(regex="a+"))
        queue.add(slow)
        queue.add(fast)
        settle(queue)
        ready, refused = queue.poll()
        assert [r.rid for r in ready] == ["fast"]
        assert [(r.req.rid, r.status_code) for r in refused] == [("slow", 503)]
        assert "stopped" in refused[0].message
        assert ("json_schema", HUGE_ENUM) not in queue.cache  # a retry compiles again
        assert ("regex", "a+") in queue.cache
    finally:
        queue.shutdown()


def test_the_cache_is_bounded_by_the_bytes_of_its_grammars(tokenizer):
    backend = isolated(tokenizer)
    try:
        one = backend.compiled_bytes(backend.compile(("regex", "x0+")))
        queue = GrammarQueue(backend, timeout_s=3600.0, cache_bytes=int(2.5 * one))
        for i in range(4):
            queue.add(Req(f"r{i}", [5], SamplingParams(regex=f"x{i}+")))
            settle(queue)
            queue.poll()
        assert list(queue.cache) == [("regex", "x2+"), ("regex", "x3+")]
        queue.shutdown()
    finally:
        backend.shutdown()


def test_the_memory_flag_validates():
    from sglite.config import ServerArgs

    assert ServerArgs().grammar_compile_max_memory_mb == 1024
    with pytest.raises(ValueError, match="--grammar-compile-max-memory-mb: must be >= 16"):
        ServerArgs(grammar_compile_max_memory_mb=8)
