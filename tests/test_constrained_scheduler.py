"""Structured output through the scheduler on the tiny random-weight model (xgrammar backend).

Every grammar below is finite (bounded integers and numbers, patterned strings, enums, bounded
arrays and repetitions), so even a random model must complete it within max_new_tokens: each
constrained request must finish by its grammar (EOS accepted), and its text must parse and
validate (jsonschema) or fullmatch (re). Both loops give the same tokens; unconstrained
requests in the same batches are unaffected; retraction (a tiny KV pool) changes no token.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pytest
import torch

from sglite.config import ServerArgs
from sglite.messages import GenerateReq
from sglite.sampling_params import SamplingParams
from sglite.scheduler.process import scheduler_for_runner

EOS = 2
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 999},
                    "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                },
                "required": ["id", "name"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "version": {"const": 3},
        },
        "required": ["color", "size", "version"],
    },
    "array": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 100},
            "count": {"type": "integer", "minimum": 1, "maximum": 50},
            "ratio": {"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 1},
        },
        "required": ["price", "count", "ratio"],
    },
}
REGEXES = [
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
    r"(yes|no|maybe), [0-9]{3}-[0-9]{4}",
    r"-?(0|[1-9][0-9]{0,3})\.[0-9]{1,2}",
]
EBNF = 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}'
EBNF_AS_REGEX = r"\([1-9][0-9]{0,2}(\+[1-9][0-9]{0,2}){0,3}\)"
PROMPTS = ["The river town woke slowly", "In the library at the top of the hill", "Every good"]
TEMPERATURES = [0.0, 0.7, 1.3]  # greedy, then seeded sampling


def workload(tokenizer, with_free: bool = True, with_constrained: bool = True):
    """(rid, prompt ids, SamplingParams, check) per request; check(text) validates the text."""
    out = []

    def add(rid, prompt, check, **sp):
        sp.setdefault("max_new_tokens", 160)
        out.append((rid, tokenizer.encode(prompt), SamplingParams(**sp), check))

    for j, (prompt, temp) in enumerate(zip(PROMPTS, TEMPERATURES)):
        if with_free:
            add(f"free-{j}", prompt, None, temperature=temp, seed=j, max_new_tokens=24)
        if not with_constrained:
            continue
        for name, schema in SCHEMAS.items():

            def check(text, schema=schema):
                jsonschema.validate(json.loads(text), schema)

            add(
                f"{name}-{j}",
                prompt,
                check,
                temperature=temp,
                seed=j,
                json_schema=json.dumps(schema),
            )
        for i, regex in enumerate(REGEXES):

            def check(text, regex=regex):
                assert re.fullmatch(regex, text), text

            add(f"re{i}-{j}", prompt, check, temperature=temp, seed=j, regex=regex)
        add(
            f"ebnf-{j}",
            prompt,
            lambda text: re.fullmatch(EBNF_AS_REGEX, text) or pytest.fail(text),
            temperature=temp,
            seed=j,
            ebnf=EBNF,
        )
    return out


def run(
    model_dir, tokenizer, reqs, *, overlap: bool, total_tokens: int = 8192, device="cpu", **args
):
    from sglite.model_executor.model_runner import ModelRunner

    runner = ModelRunner(
        model_dir, device=device, max_total_tokens=total_tokens, max_running_requests=48
    )
    server_args = ServerArgs(
        max_total_tokens=total_tokens,
        disable_overlap_schedule=not overlap,
        debug_invariants=True,
        **args,
    )
    outputs: list = []
    sched = scheduler_for_runner(
        server_args,
        runner,
        outputs.append,
        decode_tail=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        tokenizer=tokenizer,
    )
    handles = {rid: sched.add_request(GenerateReq(rid, ids, sp)) for rid, ids, sp, _ in reqs}
    try:
        sched.run_until_idle()
    finally:
        sched.grammars.shutdown()  # its compile processes
    sched.cache.check_idle()
    got: dict[str, dict] = {}
    for msg in outputs:
        for rid, ids, reason in zip(msg.rids, msg.output_ids, msg.finished_reasons):
            r = got.setdefault(rid, {"ids": [], "finish": None})
            r["ids"] += ids
            r["finish"] = reason or r["finish"]
    for rid, r in got.items():
        r["text"] = tokenizer.decode(r["ids"], skip_special_tokens=True)
        r["req"] = handles[rid]
    return got, sched


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    from transformers import AutoTokenizer

    model_dir = tiny_model_dir("llama")
    return model_dir, AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def runs(setup):
    """The mixed workload under both loops, and its unconstrained part alone."""
    model_dir, tok = setup
    mixed = workload(tok)
    return {
        "reqs": mixed,
        "normal": run(model_dir, tok, mixed, overlap=False)[0],
        "overlap": run(model_dir, tok, mixed, overlap=True)[0],
        "free_only": run(model_dir, tok, workload(tok, with_constrained=False), overlap=False)[0],
    }


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_outputs_follow_their_grammar(runs, loop):
    got = runs[loop]
    checked = 0
    for rid, _, _, check in runs["reqs"]:
        if check is None:
            continue
        r = got[rid]
        assert r["finish"] == {"type": "stop", "matched": EOS}, (rid, r["finish"], r["text"])
        assert r["ids"][-1] == EOS and EOS not in r["ids"][:-1]
        check(r["text"])
        assert r["req"].grammar.is_terminated
        assert r["req"].grammar.num_accepted == len(r["ids"])
        checked += 1
    assert checked == len(PROMPTS) * (len(SCHEMAS) + len(REGEXES) + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_outputs_follow_their_grammar_on_cuda(setup):
    """The mask on the device, the overlap loop's device future buffer, CUDA graphs."""
    model_dir, tok = setup
    reqs = workload(tok)
    got, _ = run(model_dir, tok, reqs, overlap=True, device="cuda")
    for rid, _, _, check in reqs:
        if check is not None:
            assert got[rid]["finish"] == {"type": "stop", "matched": EOS}, (rid, got[rid])
            check(got[rid]["text"])


def test_both_loops_give_the_same_tokens(runs):
    for rid, *_ in runs["reqs"]:
        assert runs["normal"][rid]["ids"] == runs["overlap"][rid]["ids"], rid


def test_sampled_rows_differ_from_greedy_ones(runs):
    """Temperature really samples under the mask (not a greedy walk through it)."""
    got = runs["normal"]
    texts = {name: {got[f"{name}-{j}"]["text"] for j in range(3)} for name in SCHEMAS}
    assert sum(len(t) > 1 for t in texts.values()) >= 3, texts


def test_unconstrained_neighbours_are_unaffected(runs):
    for j in range(len(PROMPTS)):
        rid = f"free-{j}"
        assert runs["normal"][rid]["ids"] == runs["free_only"][rid]["ids"], rid
        assert runs["overlap"][rid]["ids"] == runs["free_only"][rid]["ids"], rid


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_retraction_keeps_matchers_in_step(setup, runs, overlap):
    """A KV pool so small that decode must retract: every request gives the same tokens as with
    a roomy pool (greedy, or seeded sampling: the seed's noise depends on the step only), and
    every matcher accepted exactly its request's output."""
    model_dir, tok = setup
    reqs = [
        (rid, ids, replace(sp, max_new_tokens=min(sp.max_new_tokens, 60)), check)
        for rid, ids, sp, check in runs["reqs"]
    ]
    got, sched = run(
        model_dir,
        tok,
        reqs,
        overlap=overlap,
        total_tokens=200,
        chunked_prefill_size=32,
        schedule_conservativeness=0.1,
    )
    assert sched.counters["num_retracted_reqs"] > 0, "the workload must retract"
    retracted = [rid for rid, r in got.items() if r["req"].num_retractions and r["req"].grammar]
    assert retracted, "a constrained request must be among the retracted ones"
    for rid, _, _, check in reqs:
        r = got[rid]
        assert r["ids"] == runs["normal"][rid]["ids"], rid
        if check is not None:
            assert r["req"].grammar.num_accepted == len(r["ids"]), rid
            check(r["text"])


def test_invalid_grammar_is_refused_by_the_scheduler(setup):
    """What the Engine hits when no edge check ran: the compile error finishes the request
    with a 400 naming the problem; the other requests are served."""
    model_dir, tok = setup
    bad = [
        ("bad-schema", tok.encode("x y"), SamplingParams(json_schema='{"type": "objectx"}'), None),
        ("bad-regex", tok.encode("x y"), SamplingParams(regex="a(b"), None),
        ("good", tok.encode("x y"), SamplingParams(regex="ok", temperature=0), None),
    ]
    got, sched = run(model_dir, tok, bad, overlap=False)
    schema_err, regex_err = got["bad-schema"]["finish"], got["bad-regex"]["finish"]
    assert schema_err["type"] == "abort" and schema_err["status_code"] == 400
    assert schema_err["message"] == 'json_schema: invalid schema: Unsupported type "objectx"'
    assert regex_err["status_code"] == 400
    assert regex_err["message"].startswith("regex: invalid regex:")
    assert got["good"]["text"] == "ok" and got["good"]["finish"] == {"type": "stop", "matched": EOS}
    assert sched.counters["num_rejected_reqs"] == 2


def test_grammar_backend_none_refuses_constrained_requests(setup):
    model_dir, tok = setup
    reqs = [
        ("c", tok.encode("x y"), SamplingParams(regex="ok"), None),
        ("u", tok.encode("x y"), SamplingParams(max_new_tokens=4), None),
    ]
    got, _ = run(model_dir, tok, reqs, overlap=True, grammar_backend="none")
    assert got["c"]["finish"]["status_code"] == 400
    assert "disabled on this server (--grammar-backend none)" in got["c"]["finish"]["message"]
    assert len(got["u"]["ids"]) == 4


def test_smollm2_answers_in_json(smollm2_dir):
    """A real model and vocabulary (49152 tokens): the schema's answer is the right one."""
    from sglite.server.tokenizer import load_tokenizer

    tok = load_tokenizer(str(smollm2_dir))
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

    def chat(question: str) -> list[int]:
        messages = [{"role": "user", "content": question}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    json_sp = SamplingParams(max_new_tokens=32, temperature=0, json_schema=json.dumps(schema))
    regex_sp = SamplingParams(max_new_tokens=8, temperature=0, regex="(Yes|No)[.!]")
    reqs = [
        ("json", chat("Which city is the capital of France? Answer in JSON."), json_sp, None),
        ("regex", chat("Is Paris in France? Answer yes or no."), regex_sp, None),
    ]
    got, _ = run(smollm2_dir, tok, reqs, overlap=False)
    eos = got["json"]["ids"][-1]
    assert got["json"]["finish"] == {"type": "stop", "matched": eos}
    assert json.loads(got["json"]["text"]) == {"city": "Paris"}
    assert re.fullmatch(r"(Yes|No)[.!]", got["regex"]["text"])
    assert got["regex"]["finish"] == {"type": "stop", "matched": eos}
