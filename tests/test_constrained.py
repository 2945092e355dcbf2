"""Structured output without a model: the xgrammar backend on the tiny tokenizer, the packed
token mask and the sampler under it, the grammar gate's cache, errors, timeout and aborts."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from fixtures.grammars import BlockingBackend, FakeClock, settle
from sglite.config import ServerArgs
from sglite.constrained import GrammarError, create_backend, edge_check
from sglite.constrained.base import Grammar
from sglite.constrained.grammar_queue import GrammarQueue
from sglite.constrained.mask import VocabMask, apply_vocab_mask, fill_vocab_mask, unpack
from sglite.constrained.matching import GrammarRows, accept_token, grammar_rows
from sglite.model_executor.sampler import Sampler, SamplingBatchInfo
from sglite.sampling_params import SamplingParams
from sglite.scheduler.req import Req

EOS = 2
PADDED_VOCAB = 400  # the tiny tokenizer has 384 tokens: 16 padding ids


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))


@pytest.fixture(scope="module")
def backend(tokenizer):
    return create_backend("xgrammar", tokenizer, PADDED_VOCAB, [EOS])


def allowed(grammar: Grammar, vocab: int = PADDED_VOCAB) -> set[int]:
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    grammar.fill_mask(bitmask, 0)
    return set(torch.nonzero(unpack(bitmask, vocab)[0]).flatten().tolist())


# ---------------------------------------------------------------------- params
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"json_schema": "{", "regex": "a"}, "at most one of json_schema, regex and ebnf"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"ebnf": 3}, "ebnf must be a non-empty string"),
        ({"json_schema": "{not json"}, "json_schema: invalid schema: not valid JSON"),
        ({"json_schema": "[1, 2]"}, "a schema is a JSON object"),
        ({"regex": "a+", "min_new_tokens": 2}, "min_new_tokens cannot be combined with regex"),
    ],
)
def test_sampling_params_validate_grammars(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_grammar_key():
    assert SamplingParams().grammar_key is None
    assert SamplingParams(regex="a|b").grammar_key == ("regex", "a|b")
    assert SamplingParams(json_schema="true").grammar_key == ("json_schema", "true")
    assert SamplingParams.from_dict({"ebnf": 'root ::= "x"'}).grammar_key == (
        "ebnf",
        'root ::= "x"',
    )


def test_server_args_grammar_flags():
    assert ServerArgs().grammar_backend == "xgrammar"
    with pytest.raises(ValueError, match="--grammar-backend: must be one of xgrammar, none"):
        ServerArgs(grammar_backend="outlines")
    with pytest.raises(ValueError, match="--grammar-compile-timeout: must be > 0"):
        ServerArgs(grammar_compile_timeout=0)


# ---------------------------------------------------------------------- backend
@pytest.mark.parametrize(
    ("key", "message"),
    [
        (
            ("json_schema", '{"type": "objectx"}'),
            'json_schema: invalid schema: Unsupported type "objectx"',
        ),
        (("json_schema", '{"$ref": "#/nope"}'), "json_schema: invalid schema: .*nope"),
        (("regex", "a(b"), "regex: invalid regex: .*parenthesis is not closed"),
        (("regex", "(?=x)a"), "regex: invalid regex: .*Lookahead is not supported"),
        (("ebnf", "root ::= foo"), 'ebnf: invalid grammar: .*Rule "foo" is not defined'),
        (("ebnf", 'start ::= "a"'), 'ebnf: invalid grammar: .*root rule with name "root"'),
    ],
)
def test_invalid_grammars_name_the_problem(backend, key, message):
    with pytest.raises(GrammarError, match=message) as edge:
        edge_check("xgrammar")(key)
    with pytest.raises(GrammarError, match=message) as compiled:
        backend.compile(key)
    assert "[" not in str(edge.value).split(":")[0] and ".cc" not in str(edge.value)
    assert str(edge.value) == str(compiled.value)


def test_none_backend_refuses_every_grammar(tokenizer):
    for check in (edge_check("none"), create_backend("none", tokenizer, 384, [EOS]).compile):
        with pytest.raises(GrammarError, match="regex: structured output is disabled"):
            check(("regex", "a"))
    with pytest.raises(GrammarError, match="needs the model's tokenizer"):
        create_backend("xgrammar", None, 384, [EOS]).compile(("regex", "a"))


def test_matcher_follows_the_regex_and_ends_with_eos(backend, tokenizer):
    g = backend.matcher(backend.compile(("regex", "qx|qz")))
    q, x = tokenizer.convert_tokens_to_ids(["q", "x"])
    assert allowed(g) == {q}  # no multi-character token starts "qx" or "qz"
    assert not g.accept(x) and g.num_accepted == 0
    assert g.accept(q) and g.accept(x) and g.num_accepted == 2
    assert allowed(g) == {EOS} and not g.is_terminated
    g.rollback(1)
    assert g.num_accepted == 1 and EOS not in allowed(g) and x in allowed(g)
    assert g.accept(x) and g.accept(EOS) and g.is_terminated
    assert allowed(g) == set(range(PADDED_VOCAB))  # terminated: the row is dropped anyway


def test_padding_ids_beyond_the_tokenizer_are_never_allowed(backend):
    g = backend.matcher(backend.compile(("json_schema", '{"type": "object"}')))
    g.accept(93)  # "{"
    ids = allowed(g)
    assert ids and max(ids) < 384 and 383 not in ids


# ---------------------------------------------------------------------- mask and sampler
def random_mask(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(
        -(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=gen
    )


def test_unpack_and_apply_match_a_plain_reference():
    import xgrammar

    vocab = 100
    bitmask = random_mask(3, vocab)
    reference = torch.tensor(
        [[bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for r in range(3)]
    )
    assert torch.equal(unpack(bitmask, vocab), reference)
    assert not unpack(bitmask, vocab + 40)[:, vocab + 28 :].any()  # beyond the words: banned
    logits = torch.randn(5, vocab)
    ours = apply_vocab_mask(logits.clone(), VocabMask(torch.tensor([4, 0, 2]), bitmask))
    expect = logits.clone()
    for mask_row, row in enumerate([4, 0, 2]):
        expect[row][~reference[mask_row]] = float("-inf")
    assert torch.equal(ours, expect)
    theirs = logits.clone()  # xgrammar's kernel, same layout: equal results
    full = torch.full((5, bitmask.shape[1]), -1, dtype=torch.int32)
    full[[4, 0, 2]] = bitmask
    xgrammar.apply_token_bitmask_inplace(theirs, full, indices=[4, 0, 2])
    assert torch.equal(ours, theirs)


def test_sampler_never_picks_a_masked_token():
    vocab = 64
    logits = torch.randn(4, vocab)
    logits[:, 40:] += 100.0  # the model loves the banned ids (padding, say)
    bitmask = torch.zeros((2, 2), dtype=torch.int32)
    bitmask[:, 0] = 0b1010  # rows 1 and 3 may only emit tokens 1 and 3
    mask = VocabMask(torch.tensor([1, 3]), bitmask)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=2.0),
        SamplingParams(temperature=1.5, seed=7),
        SamplingParams(temperature=2.0, frequency_penalty=-2.0, top_p=0.9),
    ]
    for trial in range(50):
        info = SamplingBatchInfo.build(
            params,
            vocab_size=vocab,
            device="cpu",
            output_ids=[[], [], [], [3] * trial],  # a negative penalty cannot revive a ban
            prompt_ids=[[], [1] * 5, [], []],
            vocab_mask=mask,
        )
        out = Sampler()(logits.clone(), info).tolist()
        assert out[1] in (1, 3) and out[3] in (1, 3), out
        assert out[0] >= 40 and out[2] >= 40  # unconstrained rows are untouched


def test_fill_vocab_mask_builds_the_constrained_rows(backend):
    g = backend.matcher(backend.compile(("regex", "qx|qz")))
    assert fill_vocab_mask(None, PADDED_VOCAB, "cpu") is None
    mask = fill_vocab_mask(GrammarRows(3, [2], [g]), PADDED_VOCAB, "cpu")
    assert mask.rows.tolist() == [2] and mask.bitmask.shape == (1, 13)
    filled = unpack(mask.bitmask, PADDED_VOCAB)[0]
    assert set(torch.nonzero(filled).flatten().tolist()) == allowed(g)


# ---------------------------------------------------------------------- scheduler-side matching
def req_with(grammar: Grammar | None, output: list[int]) -> Req:
    req = Req("r", [5, 6], SamplingParams(regex="qx|qz") if grammar else SamplingParams())
    req.grammar, req.output_ids = grammar, list(output)
    return req


def test_grammar_rows_roll_back_tokens_the_output_lost(backend, tokenizer):
    q, x = tokenizer.convert_tokens_to_ids(["q", "x"])
    g = backend.matcher(backend.compile(("regex", "qx|qz")))
    assert g.accept(q) and g.accept(x)
    free, constrained = req_with(None, [9]), req_with(g, [q])  # "x" was discarded
    assert grammar_rows([free], [True]) is None
    rows = grammar_rows([free, constrained, req_with(g, [])], [True, True, False])
    assert rows.row_idx == [1] and rows.grammars == [g] and rows.batch_size == 3
    assert g.num_accepted == 1 and allowed(g) == set(tokenizer.convert_tokens_to_ids(["x", "z"]))


def test_accept_token_finishes_on_the_grammar(backend, tokenizer):
    q, x = tokenizer.convert_tokens_to_ids(["q", "x"])
    req = req_with(backend.matcher(backend.compile(("regex", "qx|qz"))), [])
    for token in (q, x):
        req.output_ids.append(token)
        assert accept_token(req, token) is None
    req.output_ids.append(EOS)
    assert accept_token(req, EOS) == {"type": "stop", "matched": EOS}
    other = req_with(backend.matcher(backend.compile(("regex", "qx|qz"))), [x])
    assert accept_token(other, x) == {"type": "stop", "matched": None}
    assert other.output_ids == []  # the refused token is not part of the output


# ---------------------------------------------------------------------- the grammar gate
def constrained(rid: str, regex: str) -> Req:
    return Req(rid, [1, 2, 3], SamplingParams(regex=regex))


def test_cache_shares_compiles_and_errors():
    backend = BlockingBackend(blocked=False)
    queue = GrammarQueue(backend, 30.0)
    reqs = [constrained("a", "x+"), constrained("b", "bad"), constrained("c", "x+")]
    for r in reqs:
        queue.add(r)
    settle(queue)
    queue.add(constrained("d", "bad"))  # a known error is a hit too
    ready, refused = queue.poll()
    assert [r.rid for r in ready] == ["a", "c"] and ready[0].grammar is not ready[1].grammar
    assert [(f.req.rid, f.status_code, f.message) for f in refused] == [
        ("b", 400, "regex: invalid regex: bad"),
        ("d", 400, "regex: invalid regex: bad"),
    ]
    assert sorted(backend.compiled) == [("regex", "bad"), ("regex", "x+")]
    assert (queue.num_compiles, queue.num_cache_hits) == (2, 2) and len(queue) == 0
    queue.shutdown()


def test_unexpected_compile_failure_is_a_500():
    queue = GrammarQueue(BlockingBackend(blocked=False), 30.0)
    queue.add(constrained("a", "boom"))
    settle(queue)
    [refusal] = queue.poll()[1]
    assert refusal.status_code == 500 and "failed to compile: out of memory" in refusal.message


def test_cache_keeps_the_most_recently_used_grammars():
    backend = BlockingBackend(blocked=False)
    queue = GrammarQueue(backend, 30.0, cache_size=2)
    for regex in ("a", "b", "a", "c"):  # "b" is the least recently used when "c" arrives
        queue.add(constrained(regex, regex))
        settle(queue)
    assert list(queue.cache) == [("regex", "a"), ("regex", "c")]
    queue.add(constrained("b2", "b"))
    settle(queue)
    assert backend.compiled.count(("regex", "b")) == 2


def test_timeout_refuses_and_the_compile_lands_in_the_cache():
    backend, clock = BlockingBackend(), FakeClock()
    queue = GrammarQueue(backend, 5.0, clock=clock)
    queue.add(constrained("slow", "x"))
    clock.now += 4.9
    assert queue.poll() == ([], []) and len(queue) == 1
    clock.now += 0.2
    ready, [refusal] = queue.poll()
    assert ready == [] and refusal.req.rid == "slow" and refusal.status_code == 503
    assert "did not compile within 5 s (--grammar-compile-timeout)" in refusal.message
    backend.release.set()
    settle(queue)
    queue.add(constrained("retry", "x"))
    assert [r.rid for r in queue.poll()[0]] == ["retry"] and queue.num_cache_hits == 1


def test_remove_takes_requests_out_while_they_compile():
    backend = BlockingBackend()
    queue = GrammarQueue(backend, 30.0)
    for rid in ("keep", "drop1", "drop2"):
        queue.add(constrained(rid, "x"))
    gone = queue.remove(lambda r: r.rid.startswith("drop"))
    assert [r.rid for r in gone] == ["drop1", "drop2"] and len(queue) == 1
    backend.release.set()
    settle(queue)
    assert [r.rid for r in queue.poll()[0]] == ["keep"]


def test_wait_returns_when_a_compile_lands():
    backend = BlockingBackend()
    queue = GrammarQueue(backend, 30.0)
    queue.add(constrained("a", "x"))
    done = threading.Event()

    def waiter() -> None:
        queue.wait(timeout_s=60)
        done.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    backend.release.set()
    assert done.wait(30), "wait() did not wake up when the compile finished"
    thread.join()


def test_json_schema_example_from_the_readme_is_valid(backend):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    edge_check("xgrammar")(("json_schema", json.dumps(schema)))
    assert backend.compile(("json_schema", json.dumps(schema))) is not None
