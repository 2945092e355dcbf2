"""MoE models through the rest of the engine: scheduler loops, tree cores, TP, bench, API.

The real scheduler (chunked prefill, radix cache with shared system prompts, eviction
under a small KV pool) on tiny Qwen2-MoE (shared expert, a dense layer) gives
transformers' greedy tokens for both loops (normal, overlap), both tree cores and page
sizes 1 and 16 (every pair of those values, in four runs). The Engine on Qwen3-MoE: log-probs
equal transformers' log-softmax, and a JSON schema constrains its output. `--tp-size 2` (gloo,
spawned ranks) on all four families and gpt-oss (its sinks split by query head) equals tp 1
(logits 1e-4) and transformers' greedy tokens. bench_one_batch runs a MoE model.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.model_driver import hf_greedy
from fixtures.tp_worker import DECODE_STEPS, PROMPTS, run_tp_ranks, run_workload
from sglite.config import ServerArgs
from sglite.messages import GenerateReq
from sglite.sampling_params import SamplingParams
from sglite.scheduler.process import scheduler_for_runner

MOE_ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss")
ATOL = 1e-4


def _workload(vocab: int, seed: int = 0) -> list[tuple[str, list[int], int]]:
    """Half the requests share one of two system prompts (cache hits), half decode long."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(40)] for _ in range(2)]
    reqs = []
    for i in range(14):
        if i % 2:
            prompt, n = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 16))], 30
        else:
            prompt = systems[i % 4 // 2] + [rng.randrange(3, vocab) for _ in range(12)]
            n = rng.randrange(2, 8)
        reqs.append((f"req{i}", prompt, n))
    return reqs


@pytest.fixture(scope="module")
def scheduler_case(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("qwen2_moe")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reqs = _workload(hf.config.vocab_size)
    expected = {}
    with torch.inference_mode():
        for rid, prompt, n in reqs:  # greedy with transformers' KV cache, exactly n tokens
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
            expected[rid] = out[0, len(prompt) :].tolist()
    return path, reqs, expected


# Every pair of (tree core, loop, page size) values in four runs instead of eight.
SCHEDULER_MATRIX = [
    ("python", False, 1),
    ("rust", True, 1),
    ("python", True, 16),
    ("rust", False, 16),
]


@pytest.mark.parametrize(
    ("core_name", "overlap", "page_size"),
    SCHEDULER_MATRIX,
    ids=[f"{c}-{'overlap' if o else 'normal'}-page{p}" for c, o, p in SCHEDULER_MATRIX],
)
def test_scheduler_gives_transformers_tokens(scheduler_case, core_name, overlap, page_size):
    from fixtures.backends import load_backend
    from sglite.model_executor.model_runner import ModelRunner

    core = load_backend(core_name)
    path, reqs, expected = scheduler_case
    total = 240
    runner = ModelRunner(
        path, device="cpu", page_size=page_size, max_total_tokens=total,
        max_running_requests=16, tree_core=core.name,
    )  # fmt: skip
    args = ServerArgs(
        page_size=page_size, max_total_tokens=total, chunked_prefill_size=32,
        disable_overlap_schedule=not overlap, debug_invariants=True, tree_core=core.name,
        schedule_policy="lpm",
    )  # fmt: skip
    outputs = []
    sched = scheduler_for_runner(args, runner, outputs.append)
    sched.stop_checker.eos_token_ids = set()
    for rid, prompt, n in reqs:
        sched.add_request(GenerateReq(rid, prompt, SamplingParams(max_new_tokens=n, temperature=0)))
    sched.run_until_idle()
    sched.cache.check_idle()
    got: dict[str, list[int]] = {}
    for msg in outputs:
        for rid, ids in zip(msg.rids, msg.output_ids):
            got.setdefault(rid, []).extend(ids)
    for rid, _, _ in reqs:
        assert got[rid] == expected[rid], f"{rid} differs from transformers"
    c = sched.counters
    assert c["num_chunks"] > 0, "the workload must chunk"
    assert c["num_cached_tokens_total"] > 0, "shared prefixes must hit the cache"
    assert sched.cache.num_evicted_tokens > 0, "the workload must evict"


def test_engine_logprobs_and_structured_output(tiny_model_dir):
    import json

    import jsonschema
    from transformers import AutoModelForCausalLM

    import sglite

    path = tiny_model_dir("qwen3_moe")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
    }
    prompt, steps = list(PROMPTS[0]) * 2, 6
    with sglite.Engine(model_path=str(path), max_total_tokens=2048, log_level="warning") as engine:
        out = engine.generate(
            input_ids=prompt,
            sampling_params={"max_new_tokens": steps, "temperature": 0, "ignore_eos": True},
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=2,
        )
        structured = engine.generate(
            "The river town",
            {
                "max_new_tokens": 40,
                "temperature": 0.9,
                "seed": 3,
                "json_schema": json.dumps(schema),
            },
        )
    tokens, ref_logits = hf_greedy(hf, prompt, steps)
    assert out["output_ids"] == tokens
    meta = out["meta_info"]
    for (logprob, token, _), logits in zip(meta["output_token_logprobs"], ref_logits):
        assert abs(logprob - logits.log_softmax(-1)[token].item()) < 5e-4
    with torch.no_grad():
        ref_in = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for i, (logprob, token, _) in enumerate(meta["input_token_logprobs"][1:], start=1):
        assert token == prompt[i] and abs(logprob - ref_in[i - 1, token].item()) < 5e-4
    top = [t for _, t, _ in meta["output_top_logprobs"][0]]
    assert top == ref_logits[0].topk(2).indices.tolist()
    assert structured["meta_info"]["finish_reason"]["type"] == "stop", structured
    jsonschema.validate(json.loads(structured["text"]), schema)


def test_tp2_matches_tp1_and_transformers(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from sglite.layers.moe import SparseMoeBlock
    from sglite.model_executor.model_runner import ModelRunner

    paths = {arch: tiny_model_dir(arch) for arch in MOE_ARCHS}
    failures = run_tp_ranks(2, list(paths.items()), tmp_path, timeout_s=300)
    assert not failures, "\n".join(failures)
    for arch, path in paths.items():
        ranks = [torch.load(tmp_path / f"{arch}.rank{r}.pt") for r in range(2)]
        tp1 = ModelRunner(path, device="cpu", max_total_tokens=256, max_running_requests=4)
        block = next(m for m in tp1.model.modules() if isinstance(m, SparseMoeBlock))
        assert block.experts.shard.inter_size == 32  # tp 1 holds whole experts
        ref = run_workload(tp1)
        for rank, got in enumerate(ranks):
            for step, (a, b) in enumerate(zip(got["logits"], ref["logits"])):
                err = (a - b).abs().max().item()
                assert err <= ATOL, f"{arch} rank {rank} step {step}: logits differ by {err}"
            assert got["sampled"] == ranks[0]["sampled"]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for i, prompt in enumerate(PROMPTS):
            expected, _ = hf_greedy(hf, list(prompt), DECODE_STEPS + 1)
            assert [t[i] for t in ranks[0]["tokens"]] == expected, f"{arch} prompt {i}"


def test_tp2_shards_each_expert_in_half(tiny_model_dir):
    """Loading alone (one process, rank 1 of 2 without a group): the shard's shapes."""
    from sglite.distributed import TPGroup
    from sglite.layers.moe import SparseMoeBlock
    from sglite.models.loader import iter_weights, load_model
    from sglite.models.model_config import ModelConfig

    class Rank1(TPGroup):
        size, rank = 2, 1

    path = tiny_model_dir("qwen2_moe")
    model = load_model(path, ModelConfig.from_pretrained(path), dtype=torch.float32,
                       device=torch.device("cpu"), tp_group=Rank1())  # fmt: skip
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    assert tuple(block.experts.w13_weight.shape) == (8, 32, 64)  # 8 experts x (16 + 16) rows
    assert block.shared_expert.down_proj.weight.shape == (64, 24)
    full = dict(iter_weights(path))
    up = full["model.layers.0.mlp.experts.5.up_proj.weight"]
    torch.testing.assert_close(block.experts.w13_weight[5, 16:], up[16:])


def test_bench_one_batch_runs_a_moe_model(tiny_model_dir):
    from sglite.bench_one_batch import main

    argv = ["--model-path", str(tiny_model_dir("qwen3_moe")), "--device", "cpu"]
    r = main([*argv, "--batch-size", "4", "--input-len", "16", "--output-len", "4"])
    assert r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0
