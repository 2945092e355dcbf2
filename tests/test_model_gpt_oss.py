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

import functools
import random

import pytest
import torch

from fixtures.model_checks import (
    SCHEDULER_IDS,
    SCHEDULER_MATRIX,
    check_chunked,
    check_greedy,
    check_one_shot,
    check_scheduler_tokens,
    check_warm_prefix,
    fragmented_runner,
    hf_generate_exact,
    hf_reference,
    hf_routes,
    load_hf,
    run_scheduler,
)
from fixtures.model_driver import Driver
from fixtures.tiny_moe import GPT_OSS_WINDOW

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
    return load_hf(path)


@pytest.fixture(scope="module")
def hf_ref(hf):
    """(prompt logits, generate's tokens, generate's logits)."""
    return hf_reference(hf, PROMPT, DECODE_STEPS)


@pytest.fixture(scope="module")
def runner(path):
    return functools.cache(lambda page_size: fragmented_runner(path, page_size))


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
    clamped = []
    limit = hf.config.swiglu_limit
    for layer in hf.model.layers:
        experts, apply = layer.mlp.experts, layer.mlp.experts._apply_gate

        def record(gate_up, apply=apply):
            clamped.append((gate_up.abs() > limit).float().mean().item())
            return apply(gate_up)

        experts._apply_gate = record
    try:
        chosen = hf_routes(hf, PROMPT, "mlp.router")
    finally:
        for layer in hf.model.layers:
            del layer.mlp.experts._apply_gate
    pairs = [len({tuple(sorted(row)) for row in ids.tolist()}) for ids in chosen]
    assert len(pairs) == 4 and min(pairs) >= 4, f"expert pairs per layer: {pairs}"
    assert 0.05 < sum(clamped) / len(clamped) < 0.95, f"clamped share: {clamped}"


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_prefill_one_shot_chunked_and_warm_match_transformers(page_size, runner, hf_ref):
    driver, ref = Driver(runner(page_size)), hf_ref[0]
    assert ref.std() > 0.1, "degenerate model: the test would not catch much"
    cold = check_one_shot(driver, PROMPT, ref, ATOL)
    check_chunked(driver, PROMPT, ref, CHUNKS, ATOL)
    # a cached prefix longer than the window
    check_warm_prefix(driver, cold, PROMPT, ref, page_size, ATOL)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_greedy_decode_matches_transformers_generate(page_size, runner, hf_ref):
    _, expected, ref_logits = hf_ref
    check_greedy(Driver(runner(page_size)), PROMPT, DECODE_STEPS, expected, ref_logits, ATOL)


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
    expected = hf_generate_exact(hf, reqs)
    return reqs, expected


@pytest.mark.parametrize(("core_name", "overlap", "page_size"), SCHEDULER_MATRIX, ids=SCHEDULER_IDS)
def test_scheduler_gives_transformers_tokens(path, scheduler_case, core_name, overlap, page_size):
    from fixtures.backends import load_backend

    reqs, expected = scheduler_case
    got, sched = run_scheduler(
        load_backend(core_name), path, reqs, page_size=page_size, policy="lpm", overlap=overlap,
        total_tokens=160, max_running_requests=8, chunked_prefill_size=16,
    )  # fmt: skip
    check_scheduler_tokens(got, sched, reqs, expected, evict=False)
