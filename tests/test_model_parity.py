"""Tiny Llama / Qwen2 / Qwen3 through the paged KV cache match transformers on the same weights.

Each case runs on a fragmented allocator (`fragment_allocator`), so the slots of every
request are non-contiguous and out of order, with page sizes 1 and 16.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.model_driver import Driver, fragment_allocator, hf_greedy, is_scrambled

ARCHS = ("llama", "qwen2", "qwen3")
PAGE_SIZES = (1, 16)
PROMPT = list(range(3, 43))  # 40 tokens: crosses two page boundaries at page size 16
ATOL = 1e-3


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def hf_models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(arch: str):
        if arch not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=torch.float32)
            cache[arch] = model.eval()
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def runners(tiny_runner):
    cache = {}

    def get(arch: str, page_size: int):
        if (arch, page_size) not in cache:
            runner = tiny_runner(arch, page_size=page_size)
            fragment_allocator(runner.allocator, seed=page_size)
            cache[arch, page_size] = runner
        return cache[arch, page_size]

    return get


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_and_greedy_decode_match_transformers(arch, page_size, runners, hf_models):
    runner, hf = runners(arch, page_size), hf_models(arch)
    driver = Driver(runner)
    seq = driver.new_seq()
    logits = driver.extend([seq], [PROMPT], return_all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    assert logits.shape == ref.shape
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    assert is_scrambled(seq.slots, page_size), seq.slots

    expected, ref_logits = hf_greedy(hf, PROMPT, 33)
    tokens = [int(logits[-1].argmax())]
    for step in range(32):
        out = driver.decode([seq], [tokens[-1]])[0]
        torch.testing.assert_close(out, ref_logits[step + 1], atol=ATOL, rtol=0)
        tokens.append(int(out.argmax()))
    assert tokens == expected
    assert len(set(tokens)) > 3, "degenerate model: the test would not catch much"
    driver.release(seq)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_four_equals_each_alone(arch, page_size, runners):
    runner = runners(arch, page_size)
    driver = Driver(runner)
    prompts = [_prompt(n, seed) for seed, n in enumerate((5, 17, 33, 40))]
    alone = []
    for p in prompts:
        seq = driver.new_seq()
        alone.append(driver.greedy([seq], [p], steps=6)[0])
        driver.release(seq)
    seqs = [driver.new_seq() for _ in prompts]
    first = driver.extend(seqs, prompts)
    singles = []
    for p in prompts:
        seq = driver.new_seq()
        singles.append(driver.extend([seq], [p])[0])
        driver.release(seq)
    torch.testing.assert_close(first, torch.stack(singles), atol=1e-4, rtol=0)
    outs = [[t] for t in first.argmax(-1).tolist()]
    for _ in range(5):
        step = driver.decode(seqs, [o[-1] for o in outs])
        for o, t in zip(outs, step.argmax(-1).tolist()):
            o.append(t)
    assert outs == alone
    for s in seqs:
        driver.release(s)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_reuse_equals_cold_run(arch, page_size, runners):
    runner = runners(arch, page_size)
    driver = Driver(runner)
    cold = driver.new_seq()
    cold_logits = driver.extend([cold], [PROMPT], return_all_logits=True)
    half = 16 if page_size == 16 else 19  # cached prefixes are whole pages
    warm = driver.new_seq(prefix=cold, prefix_len=half)
    warm_logits = driver.extend([warm], [PROMPT[half:]], return_all_logits=True)
    assert warm.slots[:half] == cold.slots[:half]
    torch.testing.assert_close(warm_logits, cold_logits[half:], atol=1e-4, rtol=0)
    # The two sequences now decode side by side from their own, diverging, last pages.
    step = driver.decode([cold, warm], [7, 7])
    torch.testing.assert_close(step[0], step[1], atol=1e-4, rtol=0)
    driver.release(warm)
    driver.release(cold)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_mixed_batch_equals_separate_runs(page_size, runners):
    runner = runners("qwen2", page_size)
    driver = Driver(runner)
    a, b = driver.new_seq(), driver.new_seq()
    driver.extend([a], [_prompt(21, 5)])
    ref_decode = driver.decode([a], [11])[0]
    c = driver.new_seq()
    ref_prefill = driver.extend([c], [_prompt(9, 6)])[0]
    driver.release(c)
    # Rebuild a's state without its last token, then run its decode as a 1-token extend
    # next to b's prefill.
    a2 = driver.new_seq()
    driver.extend([a2], [_prompt(21, 5)])
    mixed = driver.extend([a2, b], [[11], _prompt(9, 6)], mixed=True)
    torch.testing.assert_close(mixed[0], ref_decode, atol=1e-4, rtol=0)
    torch.testing.assert_close(mixed[1], ref_prefill, atol=1e-4, rtol=0)
    for s in (a, a2, b):
        driver.release(s)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "linear", "factor": 2.0},
    ],
    ids=["llama3", "linear"],
)
def test_rope_scaling_matches_transformers(rope_scaling, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from sglite.model_executor.model_runner import ModelRunner

    path = tiny_model_dir("llama", rope_scaling=rope_scaling)
    runner = ModelRunner(path, device="cpu", max_total_tokens=512)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = _prompt(100, 9)
    seq = Driver(runner).new_seq()
    logits = Driver(runner).extend([seq], [prompt], return_all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
