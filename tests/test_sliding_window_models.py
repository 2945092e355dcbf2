"""Models with sliding-window layers match transformers for prompts longer than the window.

A tiny Mistral (3 layers, every one with a window of 8) and a tiny Qwen2 with windows on
its later layers only (`max_window_layers`: full, sliding, sliding), on fragmented
allocators (page sizes 1 and 16), on each attention backend: prefill logits within 1e-4
of transformers' and greedy tokens equal to its greedy output; the same prompt prefilled
in chunks across the window boundary; a request reusing a cached prefix (the radix cache's
case) equal to the cold run; the real scheduler (chunked prefill, radix cache, eviction,
retraction) giving transformers' greedy tokens. And how the per-layer windows are read
from HF configs.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.model_driver import Driver, fragment_allocator, hf_greedy
from sglite.models.model_config import ModelConfig, _layer_sliding_windows

ATOL = 1e-4
WINDOW = 8
MODELS = {
    "mistral": dict(sliding_window=WINDOW, num_hidden_layers=3),
    "qwen2": dict(sliding_window=WINDOW, max_window_layers=1, num_hidden_layers=3),
}
PROMPT = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(4)).tolist()


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return lambda arch: tiny_model_dir(arch, **MODELS[arch])


@pytest.fixture(scope="module")
def hf_prompt(tiny_hf_model):
    """transformers' logits of every PROMPT position, and its 12 greedy tokens after it."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            hf = tiny_hf_model(arch, **MODELS[arch])
            with torch.no_grad():
                logits = hf(torch.tensor([PROMPT])).logits[0].float()
            cache[arch] = logits, hf_greedy(hf, PROMPT, 12)
        return cache[arch]

    return get


def _driver(model_dir, arch: str, page_size: int, backend: str | None = None) -> Driver:
    from sglite.model_executor.model_runner import ModelRunner

    runner = ModelRunner(
        model_dir(arch),
        device="cpu",
        page_size=page_size,
        max_total_tokens=1024,
        max_running_requests=8,
        attention_backend=backend,
    )
    fragment_allocator(runner.allocator, seed=page_size)
    return Driver(runner)


def _greedy_match(driver: Driver, seq, first_logits, hf_tokens, hf_logits) -> None:
    tokens = [int(first_logits.argmax())]
    for step in range(len(hf_tokens) - 1):
        out = driver.decode([seq], [tokens[-1]])[0]
        torch.testing.assert_close(out, hf_logits[step + 1], atol=ATOL, rtol=0)
        tokens.append(int(out.argmax()))
    assert tokens == hf_tokens
    assert len(set(tokens)) > 2, "degenerate model: the test would not catch much"


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
def test_prefill_and_greedy_decode_match_transformers(
    backend, arch, page_size, model_dir, hf_prompt
):
    ref, (hf_tokens, hf_logits) = hf_prompt(arch)
    driver = _driver(model_dir, arch, page_size, backend)
    assert driver.runner.model_config.context_length == 512  # no longer capped at the window
    seq = driver.new_seq()
    logits = driver.extend([seq], [PROMPT], return_all_logits=True)
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    _greedy_match(driver, seq, logits[-1], hf_tokens, hf_logits)


def test_triton_backend_matches_transformers(model_dir, hf_prompt):
    """The Triton kernels (interpreted) on the mixed-window Qwen2, page size 16."""
    kernels = pytest.importorskip("sglite_kernels")
    if not kernels.interpreted():
        pytest.skip("CPU triton cases need Triton's interpreter, off under SGL_TEST_GPU=1")
    ref, (hf_tokens, hf_logits) = hf_prompt("qwen2")
    driver = _driver(model_dir, "qwen2", 16, "triton")
    seq = driver.new_seq()
    logits = driver.extend([seq], [PROMPT], return_all_logits=True)
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    _greedy_match(driver, seq, logits[-1], hf_tokens[:6], hf_logits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", list(MODELS))
def test_triton_on_cuda_with_graphs_matches_transformers(arch, model_dir, hf_prompt):
    """The compiled kernels (fp32) and the decode CUDA graphs, with windowed layers."""
    from sglite.model_executor.model_runner import ModelRunner

    ref, (hf_tokens, hf_logits) = hf_prompt(arch)
    runner = ModelRunner(
        model_dir(arch), device="cuda", dtype="float32", page_size=16, max_total_tokens=1024,
        max_running_requests=8, attention_backend="triton",
    )  # fmt: skip
    driver = Driver(runner)
    seq = driver.new_seq()
    logits = driver.extend([seq], [PROMPT], return_all_logits=True).cpu()
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    tokens = [int(logits[-1].argmax())]
    for _ in range(len(hf_tokens) - 1):
        tokens.append(int(driver.decode([seq], [tokens[-1]])[0].argmax()))
    assert tokens == hf_tokens
    assert runner.graph_runner.num_replays > 0


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", list(MODELS))
def test_chunked_prefill_across_the_window(arch, page_size, model_dir, hf_prompt):
    """Chunks of 5, 11, 9 and 15 tokens: each one's window reaches back into the chunks
    before it (the cached prefix), the later ones past the start of the prompt."""
    ref, (hf_tokens, hf_logits) = hf_prompt(arch)
    driver = _driver(model_dir, arch, page_size)
    seq, at = driver.new_seq(), 0
    for size in (5, 11, 9, 15):
        logits = driver.extend([seq], [PROMPT[at : at + size]], return_all_logits=True)
        torch.testing.assert_close(logits, ref[at : at + size], atol=ATOL, rtol=0)
        at += size
    _greedy_match(driver, seq, logits[-1], hf_tokens, hf_logits)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", list(MODELS))
def test_warm_prefix_cache_equals_the_cold_run(arch, page_size, model_dir, hf_prompt):
    """A second request reusing the first one's cached prefix (longer than the window) gets
    the cold run's logits, and the two then decode alike from their own last pages."""
    ref, _ = hf_prompt(arch)
    driver = _driver(model_dir, arch, page_size)
    cold = driver.new_seq()
    cold_logits = driver.extend([cold], [PROMPT], return_all_logits=True)
    cached = 32 if page_size == 16 else 27  # cached prefixes are whole pages
    warm = driver.new_seq(prefix=cold, prefix_len=cached)
    warm_logits = driver.extend([warm], [PROMPT[cached:]], return_all_logits=True)
    assert warm.slots[:cached] == cold.slots[:cached]
    torch.testing.assert_close(warm_logits, cold_logits[cached:], atol=ATOL, rtol=0)
    torch.testing.assert_close(warm_logits, ref[cached:], atol=ATOL, rtol=0)
    # side by side in one batch, then the warm one as a decode row of a mixed batch
    step = driver.decode([cold, warm], [7, 7])
    torch.testing.assert_close(step[0], step[1], atol=ATOL, rtol=0)
    other = driver.new_seq()
    mixed = driver.extend([warm, other], [[9], PROMPT[:20]], mixed=True)
    alone = driver.decode([cold], [9])[0]
    torch.testing.assert_close(mixed[0], alone, atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[1], ref[19], atol=ATOL, rtol=0)


# ---------------------------------------------------------------- reading the config


def _windows(config) -> tuple:
    config.architectures = ["X"]
    return ModelConfig.from_hf(config).layer_sliding_windows


def test_per_layer_windows_from_hf_configs():
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
    )

    assert _windows(MistralConfig(num_hidden_layers=3, sliding_window=32)) == (32, 32, 32)
    assert _windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == (None, None)
    assert _windows(LlamaConfig(num_hidden_layers=2)) == (None, None)
    qwen2 = Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2
    )
    assert _windows(qwen2) == (None, None, 16, 16)
    off = Qwen2Config(num_hidden_layers=2, use_sliding_window=False, sliding_window=16)
    assert _windows(off) == (None, None)
    assert _windows(Gemma2Config(num_hidden_layers=4, sliding_window=64)) == (64, None, 64, None)
    gemma3 = Gemma3TextConfig(num_hidden_layers=7, sliding_window=512)
    assert _windows(gemma3) == (512,) * 5 + (None, 512)
    cfg = ModelConfig.from_hf(gemma3)
    assert [cfg.sliding_window_for(i) for i in (4, 5)] == [512, None]


def test_configs_sglite_cannot_attend_are_refused():
    from transformers import Gemma3TextConfig

    encoder = Gemma3TextConfig(num_hidden_layers=2, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        _windows(encoder)

    class Hybrid:
        layer_types = None

    hybrid = Hybrid()
    hybrid.sliding_window, hybrid.layer_types = 8, ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\]"):
        _layer_sliding_windows(hybrid, 2)
    with pytest.raises(ValueError, match="2 entries for 3 layers"):
        _layer_sliding_windows(hybrid, 3)


# ---------------------------------------------------------------- through the scheduler


@pytest.fixture(scope="module")
def scheduler_workload(model_dir):
    """16 requests (half sharing 64-token system prompts) and transformers' greedy tokens."""
    from transformers import AutoConfig

    from test_scheduler_model import hf_reference, make_workload

    path = model_dir("mistral")
    reqs = make_workload(AutoConfig.from_pretrained(path).vocab_size, seed=3)[:16]
    return path, reqs, hf_reference(path, reqs)


@pytest.mark.parametrize("page_size,mixed", [(1, False), (16, True)], ids=["p1", "p16-mixed"])
def test_scheduler_greedy_tokens_match_transformers(core, scheduler_workload, page_size, mixed):
    """The real scheduler on the windowed Mistral: 32-token prefill chunks (each crossing
    the window of 8), 64-token shared system prompts from the radix cache, eviction and
    retraction under a small pool; every request's greedy tokens are transformers'."""
    from test_scheduler_model import run_engine

    path, reqs, expected = scheduler_workload
    got, sched = run_engine(
        core, path, reqs, page_size=page_size, policy="lpm", overlap=False, mixed=mixed
    )
    for rid, _, _ in reqs:
        assert got[rid] == expected[rid], f"{rid} differs from transformers"
    assert sched.counters["num_chunks"] > 0, "the workload must chunk"
    assert sched.counters["num_cached_tokens_total"] > 0, "shared prefixes must hit the cache"
