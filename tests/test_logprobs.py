"""Log-probs: the batch math against a plain log-softmax, and the scheduler on a tiny model
against transformers' log-softmax (prompt positions from logprob_start_len, output tokens,
top-k, asked-for ids), with chunked prefill, a warm prefix cache, retraction, both loops."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from sglite.config import ServerArgs
from sglite.logprobs import (
    LogprobOptions,
    RowLogprobSpec,
    compute_logprobs,
    logits_rows,
)
from sglite.messages import GenerateReq
from sglite.sampling_params import SamplingParams
from sglite.scheduler.process import scheduler_for_runner

TOL = 1e-3


# ---------------------------------------------------------------------- batch math
def test_logits_rows_put_sampling_rows_first_then_asked_positions():
    specs = [
        RowLogprobSpec(0, None, True, 3, np.array([5, 6])),  # row 0: positions [2, 6)
        None,  # row 1: positions [0, 3)
        RowLogprobSpec(0, None, False, 0, np.array([1, 2, 3])),  # row 2: positions [0, 4)
    ]
    rows = logits_rows(specs, [2, 0, 0], [6, 3, 4])
    # flat offsets of the rows: 0, 4, 7; last tokens 3, 6, 10; then 0+(3-2)+[0,1], 7+[0,1,2]
    assert rows.tolist() == [3, 6, 10, 1, 2, 7, 8, 9]
    assert logits_rows([None, RowLogprobSpec(2, None, True)], [0, 0], [3, 1]) is None


def test_compute_matches_log_softmax():
    torch.manual_seed(0)
    vocab = 50
    specs = [
        RowLogprobSpec(3, (4, 7), True, 0, np.array([11, 12])),
        None,
        RowLogprobSpec(0, None, True),
        RowLogprobSpec(5, None, False, 2, np.array([9])),
    ]
    logits = torch.randn(4 + 3, vocab)
    tokens = torch.tensor([1, 2, 3, 4])
    out = compute_logprobs(logits, tokens, specs)
    ref = torch.log_softmax(logits, -1)
    assert out[1] is None
    r0 = out[0]
    assert r0.output.token_id == 1 and abs(r0.output.logprob - ref[0, 1].item()) < 1e-6
    top = ref[0].topk(3)
    assert [t[1] for t in r0.output.top] == top.indices.tolist()
    assert r0.output.selected == ((ref[0, 4].item(), 4), (ref[0, 7].item(), 7))
    assert [(e.token_id, round(e.logprob, 5)) for e in r0.input] == [
        (11, round(ref[4, 11].item(), 5)),
        (12, round(ref[5, 12].item(), 5)),
    ]
    assert out[2].output.top is None and out[2].input == []
    assert out[3].output is None and len(out[3].input) == 1
    assert [t[1] for t in out[3].input[0].top] == ref[6].topk(5).indices.tolist()


def test_options_validation():
    with pytest.raises(ValueError, match="logprob_start_len"):
        LogprobOptions.from_request(logprob_start_len=-2, vocab_size=10)
    with pytest.raises(ValueError, match="top_logprobs_num"):
        LogprobOptions.from_request(top_logprobs_num=11, vocab_size=10)
    with pytest.raises(ValueError, match="token_ids_logprob"):
        LogprobOptions.from_request(token_ids_logprob=[3, 10], vocab_size=10)
    opts = LogprobOptions.from_request(logprob_start_len=-1, vocab_size=10)
    assert opts.input_start(7) == 7


# ---------------------------------------------------------------------- the scheduler
def _requests(vocab: int, seed: int = 0):
    """Prompts longer than a chunk, some sharing a prefix; a mix of log-prob options."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    reqs = []
    starts = [0, 1, 17, 39, -1, 50, 3, 0]
    for i, start in enumerate(starts):
        prompt = shared + [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 30))]
        start = min(start, len(prompt))
        opts = LogprobOptions(
            start, top_logprobs_num=i % 3 * 2, token_ids_logprob=(5, 6) if i % 2 else None
        )
        reqs.append((f"r{i}", prompt, rng.randrange(4, 24), opts))
    return reqs


def _run(core, model_dir, reqs, *, overlap, page_size, total_tokens, warm, device="cpu"):
    from sglite.model_executor.model_runner import ModelRunner

    runner = ModelRunner(
        model_dir,
        device=device,
        dtype="float32",
        page_size=page_size,
        max_total_tokens=total_tokens,
        max_running_requests=16,
        tree_core=core.name,
    )
    args = ServerArgs(
        page_size=page_size,
        max_total_tokens=total_tokens,
        chunked_prefill_size=32,
        disable_overlap_schedule=not overlap,
        debug_invariants=True,
        schedule_conservativeness=0.1,  # eager admission: retraction
        tree_core=core.name,
    )
    outputs: list = []
    sched = scheduler_for_runner(args, runner, outputs.append)
    sched.stop_checker.eos_token_ids = set()
    if warm:  # the prompts are cached before the log-prob requests arrive
        for rid, prompt, _, _ in reqs:
            sched.add_request(GenerateReq(f"warm-{rid}", prompt, SamplingParams(max_new_tokens=1)))
        sched.run_until_idle()
        outputs.clear()
    for rid, prompt, n, opts in reqs:
        sp = SamplingParams(max_new_tokens=n, temperature=0)
        sched.add_request(GenerateReq(rid, prompt, sp, logprob=opts))
    sched.run_until_idle()
    sched.cache.check_idle()
    got: dict[str, dict] = {}
    for msg in outputs:
        for i, rid in enumerate(msg.rids):
            g = got.setdefault(rid, {"ids": [], "in": [], "out": []})
            g["ids"] += msg.output_ids[i]
            g["in"] += msg.logprobs[i].input
            g["out"] += msg.logprobs[i].output
    return got, sched


def _check_against_hf(hf, reqs, got):
    for rid, prompt, n, opts in reqs:
        g = got[rid]
        assert len(g["ids"]) == n
        seq = prompt + g["ids"]
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), -1)
        start = opts.input_start(len(prompt))
        positions = list(range(start, len(prompt)))
        assert [e.token_id for e in g["in"]] == [prompt[p] for p in positions], rid
        expected_in = [(None if p == 0 else ref[p - 1]) for p in positions]
        expected_out = [ref[len(prompt) - 1 + j] for j in range(n)]
        assert [e.token_id for e in g["out"]] == g["ids"]
        for entry, row in zip(g["in"] + g["out"], expected_in + expected_out):
            if row is None:
                assert entry.logprob is None
                continue
            assert abs(entry.logprob - row[entry.token_id].item()) < TOL, rid
            if opts.top_logprobs_num:
                vals = [v for v, _ in entry.top]
                assert np.allclose(vals, row.topk(opts.top_logprobs_num).values, atol=TOL)
                for v, t in entry.top:
                    assert abs(v - row[t].item()) < TOL
            else:
                assert entry.top is None
            if opts.token_ids_logprob:
                for v, t in entry.selected:
                    assert abs(v - row[t].item()) < TOL
        # greedy: each output token is the most likely one
        for entry, row in zip(g["out"], expected_out):
            assert abs(entry.logprob - row.max().item()) < TOL


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = tiny_model_dir("llama")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model_dir, hf, AutoConfig.from_pretrained(model_dir).vocab_size


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_logprobs_match_transformers(core, llama, overlap, page_size, warm):
    model_dir, hf, vocab = llama
    reqs = _requests(vocab)
    got, sched = _run(
        core, model_dir, reqs, overlap=overlap, page_size=page_size, total_tokens=256, warm=warm
    )
    _check_against_hf(hf, reqs, got)
    assert sched.counters["num_chunks"] > 0, "the prompts must be chunked"
    if warm:
        # requests that want no prompt log-probs still hit the cache
        assert sched.counters["num_cached_tokens_total"] > 0


def test_logprobs_survive_retraction(core, llama):
    model_dir, hf, vocab = llama
    reqs = _requests(vocab, seed=1)
    reqs = [(rid, p, n + 24, o) for rid, p, n, o in reqs]  # long outputs: memory runs out
    got, sched = _run(
        core, model_dir, reqs, overlap=True, page_size=1, total_tokens=200, warm=False
    )
    assert sched.counters["num_retracted_reqs"] > 0, "the workload must retract"
    _check_against_hf(hf, reqs, got)


def test_token_texts_of_partial_characters_are_distinct_bytes(smollm2_dir):
    """Byte tokens decode to U+FFFD alone; their entries spell their bytes instead."""
    from transformers import AutoTokenizer

    from sglite.server.logprob_format import display_text, text_bytes, token_bytes

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    partial = []
    for tid in range(tok.vocab_size):
        text = tok.decode([tid])
        raw = token_bytes(tok.convert_ids_to_tokens(tid))
        if "\ufffd" not in text:
            if raw is not None:  # the byte table agrees with the tokenizer's decoding
                assert raw.decode("utf-8") == text, tid
            continue
        shown = display_text(text, raw)
        assert shown.startswith("bytes:") and bytes(text_bytes(shown)) == raw
        partial.append(shown)
    assert len(partial) > 50 and len(set(partial)) == len(partial)  # all distinct
    assert text_bytes("é") == [0xC3, 0xA9]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_logprobs_on_cuda(core, llama, overlap):
    """The device future buffer of the overlap loop, CUDA graphs for decode."""
    model_dir, hf, vocab = llama
    reqs = _requests(vocab, seed=2)
    got, _ = _run(
        core, model_dir, reqs, overlap=overlap, page_size=16, total_tokens=256, warm=True,
        device="cuda",
    )  # fmt: skip
    _check_against_hf(hf, reqs, got)
