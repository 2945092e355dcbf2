"""gpt-oss on a tiny random checkpoint matches transformers on the same weights.

The checkpoint (tests/fixtures/tiny_moe.py): 4 layers alternating sliding (window 8) and
full attention, attention sinks, Q/K/V/o biases, YaRN RoPE, 8 biased experts of width 32
(top-2, the router's softmax over its top-2 logits) with a SwiGLU limit that the clamps hit
(checked). At page sizes 1 and 16 over a fragmented allocator: a one-shot and a chunked
prefill (chunks longer and shorter than the window), a prefill over a warm prefix longer than
the window, and greedy decoding give transformers' logits (1e-4) and tokens. The real
scheduler (chunked prefill, radix cache hits, eviction) gives transformers' greedy tokens
for every pair of (tree core, loop, page size) values in four runs. Tensor parallelism
(sinks split by query head): tests/test_moe_engine.py's tp-2 test covers gpt-oss too.
MXFP4 checkpoints: tests/test_gpt_oss_mxfp4.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.model_driver import Driver, fragment_allocator
from fixtures.tiny_moe import GPT_OSS_WINDOW
from sglite.config import ServerArgs
from sglite.messages import GenerateReq
from sglite.sampling_params import SamplingParams
from sglite.scheduler.process import scheduler_for_runner

ATOL = 1e-4
PAGE_SIZES = (1, 16)
CHUNKS = (5, 29)  # the first chunk shorter than the window, the next longer
DECODE_STEPS = 12
PROMPT = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def path(tiny_model_dir):
    return tiny_model_dir("gpt_oss")


@pytest.fixture(scope="module")
def hf(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # decode the full length
    return model


@pytest.fixture(scope="module")
def hf_ref(hf):
    """(prompt logits, generate's tokens, generate's logits)."""
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0].float()
        out = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=DECODE_STEPS, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    tokens = out.sequences[0, len(PROMPT) :].tolist()
    return logits, tokens, [s[0].float() for s in out.logits]


@pytest.fixture(scope="module")
def runner(path):
    from sglite.model_executor.model_runner import ModelRunner

    cache = {}

    def get(page_size: int):
        if page_size not in cache:
            r = ModelRunner(
                path, device="cpu", page_size=page_size, max_total_tokens=1024,
                max_running_requests=8,
            )  # fmt: skip
            fragment_allocator(r.allocator, seed=page_size)
            cache[page_size] = r
        return cache[page_size]

    return get


def test_the_model_has_the_parts_under_test(hf, runner):
    """Windows, sinks, biased router and experts are built; tokens reach many experts; the
    SwiGLU clamps bite on this prompt (else the test would not check them)."""
    from sglite.layers.moe import SparseMoeBlock

    model = runner(1).model
    assert runner(1).model_config.layer_sliding_windows == (GPT_OSS_WINDOW, None) * 2
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.sinks is not None and attn.attn.sinks is attn.sinks
        assert isinstance(mlp, SparseMoeBlock) and mlp.gate.bias is not None
        assert mlp.gate.spec.softmax_after_topk and mlp.experts.w13_bias is not None
    hf_layer = hf.model.layers[0]
    torch.testing.assert_close(model.model.layers[0].self_attn.sinks, hf_layer.self_attn.sinks)
    torch.testing.assert_close(  # the interleaved gate columns are our first I rows
        model.model.layers[0].mlp.experts.w13_bias[3, :32],
        hf_layer.mlp.experts.gate_up_proj_bias[3, 0::2],
    )
    chosen, clamped = [], []
    hooks = [
        layer.mlp.router.register_forward_hook(lambda m, i, out: chosen.append(out[2]))
        for layer in hf.model.layers
    ]
    limit = hf.config.swiglu_limit
    for layer in hf.model.layers:
        experts, apply = layer.mlp.experts, layer.mlp.experts._apply_gate

        def record(gate_up, apply=apply):
            clamped.append((gate_up.abs() > limit).float().mean().item())
            return apply(gate_up)

        experts._apply_gate = record
    try:
        with torch.no_grad():
            hf(torch.tensor([PROMPT]))
    finally:
        for h in hooks:
            h.remove()
        for layer in hf.model.layers:
            del layer.mlp.experts._apply_gate
    pairs = [len({tuple(sorted(row)) for row in ids.tolist()}) for ids in chosen]
    assert len(pairs) == 4 and min(pairs) >= 4, f"expert pairs per layer: {pairs}"
    assert 0.05 < sum(clamped) / len(clamped) < 0.95, f"clamped share: {clamped}"


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_prefill_one_shot_chunked_and_warm_match_transformers(page_size, runner, hf_ref):
    driver, ref = Driver(runner(page_size)), hf_ref[0]
    assert ref.std() > 0.1, "degenerate model: the test would not catch much"
    cold = driver.new_seq()
    logits = driver.extend([cold], [PROMPT], return_all_logits=True)
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    seq, start, chunks = driver.new_seq(), 0, []
    for end in (*CHUNKS, len(PROMPT)):
        chunks.append(driver.extend([seq], [PROMPT[start:end]], return_all_logits=True))
        start = end
    torch.testing.assert_close(torch.cat(chunks), ref, atol=ATOL, rtol=0)
    driver.release(seq)
    half = 16 if page_size == 16 else 19  # a cached prefix longer than the window
    warm = driver.new_seq(prefix=cold, prefix_len=half)
    logits = driver.extend([warm], [PROMPT[half:]], return_all_logits=True)
    assert warm.slots[:half] == cold.slots[:half]
    torch.testing.assert_close(logits, ref[half:], atol=ATOL, rtol=0)
    driver.release(warm)
    driver.release(cold)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_greedy_decode_matches_transformers_generate(page_size, runner, hf_ref):
    _, expected, ref_logits = hf_ref
    driver = Driver(runner(page_size))
    seq = driver.new_seq()
    logits = [driver.extend([seq], [PROMPT])[0]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(DECODE_STEPS - 1):
        logits.append(driver.decode([seq], [tokens[-1]])[0])
        tokens.append(int(logits[-1].argmax()))
    driver.release(seq)
    for step, (got, want) in enumerate(zip(logits, ref_logits)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=f"step {step}")
    assert tokens == expected


@pytest.fixture(scope="module")
def scheduler_case(hf):
    """Requests sharing a 24-token system prompt (cache hits past the window), and longer
    decodes; transformers' greedy tokens for each."""
    rng = random.Random(0)
    system = [rng.randrange(3, 384) for _ in range(24)]
    reqs = []
    for i in range(8):
        if i % 2:
            prompt, n = [rng.randrange(3, 384) for _ in range(rng.randrange(4, 12))], 16
        else:
            prompt, n = system + [rng.randrange(3, 384) for _ in range(8)], rng.randrange(2, 6)
        reqs.append((f"req{i}", prompt, n))
    expected = {}
    with torch.inference_mode():
        for rid, prompt, n in reqs:
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
            expected[rid] = out[0, len(prompt) :].tolist()
    return reqs, expected


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
def test_scheduler_gives_transformers_tokens(path, scheduler_case, core_name, overlap, page_size):
    from fixtures.backends import load_backend
    from sglite.model_executor.model_runner import ModelRunner

    core = load_backend(core_name)
    reqs, expected = scheduler_case
    total = 160
    runner = ModelRunner(
        path, device="cpu", page_size=page_size, max_total_tokens=total,
        max_running_requests=8, tree_core=core.name,
    )  # fmt: skip
    args = ServerArgs(
        page_size=page_size, max_total_tokens=total, chunked_prefill_size=16,
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
