"""DeepSeek-V2 / V2-Lite / V3 (multi-head latent attention, dense layers) match transformers.

Tiny random checkpoints (tests/fixtures/tiny_families.py: latent 32, rope 8, nope 16, v 24,
every layer dense): DeepSeek-V2 with q_lora_rank, V2-Lite style without it (q_proj), and V3
with yarn rope (mscale 0.9 / mscale_all_dim 0.8, so both the cos/sin factor and the softmax
scale's mscale^2 matter). On scrambled slots, page sizes 1 and 16, every CPU backend (and
Triton under its interpreter): prefill logits within 1e-4 of transformers', greedy tokens
equal to `transformers.generate`; chunked prefill; a warm prefix equal to the cold run (and
a decode row of a mixed batch); the real scheduler (both loops, both tree cores, chunking,
eviction, retraction in a pool that barely fits); HiCache (host tier loads equal to a
device-only run, a file tier read by a second scheduler); tensor parallelism (2 ranks equal
to 1). A config with mixture-of-experts layers is refused by name.
"""

from __future__ import annotations

import logging

import pytest
import torch

from fixtures.model_driver import Driver, fragment_allocator, hf_greedy

ATOL = 1e-4
MODELS = {
    "v2": ("deepseek_v2", dict(seed=1)),
    "v2_lite": ("deepseek_v2", dict(seed=2, config={"q_lora_rank": None})),
    "v3": ("deepseek_v3", dict(seed=3)),
}
PROMPT = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(5)).tolist()
STEPS = 10


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return lambda name: tiny_model_dir(MODELS[name][0], **MODELS[name][1])


@pytest.fixture(scope="module")
def hf_ref(tiny_hf_model):
    """transformers' logits of every PROMPT position, its full-forward greedy logits, and
    `generate`'s greedy tokens."""
    cache = {}

    def get(name: str):
        if name not in cache:
            arch, options = MODELS[name]
            hf = tiny_hf_model(arch, **options)
            with torch.no_grad():
                logits = hf(torch.tensor([PROMPT])).logits[0].float()
                gen = hf.generate(
                    torch.tensor([PROMPT]), max_new_tokens=STEPS, do_sample=False,
                    eos_token_id=None, pad_token_id=0,
                )[0, len(PROMPT) :].tolist()  # fmt: skip
            tokens, step_logits = hf_greedy(hf, PROMPT, STEPS)
            assert tokens == gen
            assert len(set(gen)) > 3, "degenerate model: the test would not catch much"
            cache[name] = logits, step_logits, gen
        return cache[name]

    return get


def _driver(model_dir, name: str, page_size: int, backend: str | None = None) -> Driver:
    from sglite.model_executor.model_runner import ModelRunner

    runner = ModelRunner(
        model_dir(name), device="cpu", page_size=page_size, max_total_tokens=1024,
        max_running_requests=8, attention_backend=backend,
    )  # fmt: skip
    fragment_allocator(runner.allocator, seed=page_size)
    return Driver(runner)


def _greedy(driver: Driver, seq, first_logits, step_logits, expected) -> None:
    tokens = [int(first_logits.argmax())]
    for step in range(len(expected) - 1):
        out = driver.decode([seq], [tokens[-1]])[0]
        torch.testing.assert_close(out.cpu(), step_logits[step + 1], atol=ATOL, rtol=0)
        tokens.append(int(out.argmax()))
    assert tokens == expected


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_and_greedy_decode_match_transformers(name, backend, page_size, model_dir, hf_ref):
    logits, step_logits, expected = hf_ref(name)
    driver = _driver(model_dir, name, page_size, backend)
    pool = driver.runner.kv_pool
    assert pool.values_in_keys and pool.buffers[0].shape[1:] == (1, 32 + 8)
    seq = driver.new_seq()
    out = driver.extend([seq], [PROMPT], return_all_logits=True)
    torch.testing.assert_close(out, logits, atol=ATOL, rtol=0)
    _greedy(driver, seq, out[-1], step_logits, expected)


def test_triton_backend_matches_transformers(model_dir, hf_ref):
    kernels = pytest.importorskip("sglite_kernels")
    if not kernels.interpreted():
        pytest.skip("CPU triton cases need Triton's interpreter, off under SGL_TEST_GPU=1")
    logits, step_logits, expected = hf_ref("v3")
    driver = _driver(model_dir, "v3", 16, "triton")
    seq = driver.new_seq()
    out = driver.extend([seq], [PROMPT], return_all_logits=True)
    torch.testing.assert_close(out, logits, atol=ATOL, rtol=0)
    _greedy(driver, seq, out[-1], step_logits, expected[:4])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["v2_lite", "v3"])
def test_triton_on_cuda_with_graphs_matches_transformers(name, model_dir, hf_ref):
    from sglite.model_executor.model_runner import ModelRunner

    logits, step_logits, expected = hf_ref(name)
    runner = ModelRunner(
        model_dir(name), device="cuda", dtype="float32", page_size=16, max_total_tokens=1024,
        max_running_requests=8, attention_backend="triton",
    )  # fmt: skip
    driver = Driver(runner)
    seq = driver.new_seq()
    out = driver.extend([seq], [PROMPT], return_all_logits=True).cpu()
    torch.testing.assert_close(out, logits, atol=ATOL, rtol=0)
    _greedy(driver, seq, out[-1], step_logits, expected)
    assert runner.graph_runner.num_replays > 0


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", ["v2_lite", "v3"])
def test_chunked_prefill(name, page_size, model_dir, hf_ref):
    """Chunks of 5, 11, 9 and 15 tokens, each over the latents the chunks before it stored."""
    logits, step_logits, expected = hf_ref(name)
    driver = _driver(model_dir, name, page_size)
    seq, at = driver.new_seq(), 0
    for size in (5, 11, 9, 15):
        out = driver.extend([seq], [PROMPT[at : at + size]], return_all_logits=True)
        torch.testing.assert_close(out, logits[at : at + size], atol=ATOL, rtol=0)
        at += size
    _greedy(driver, seq, out[-1], step_logits, expected)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", ["v2", "v3"])
def test_warm_prefix_cache_equals_the_cold_run(name, page_size, model_dir, hf_ref):
    logits, _, _ = hf_ref(name)
    driver = _driver(model_dir, name, page_size)
    cold = driver.new_seq()
    cold_logits = driver.extend([cold], [PROMPT], return_all_logits=True)
    cached = 32 if page_size == 16 else 27
    warm = driver.new_seq(prefix=cold, prefix_len=cached)
    warm_logits = driver.extend([warm], [PROMPT[cached:]], return_all_logits=True)
    torch.testing.assert_close(warm_logits, cold_logits[cached:], atol=ATOL, rtol=0)
    torch.testing.assert_close(warm_logits, logits[cached:], atol=ATOL, rtol=0)
    step = driver.decode([cold, warm], [7, 7])
    torch.testing.assert_close(step[0], step[1], atol=ATOL, rtol=0)
    other = driver.new_seq()  # the warm one as a decode row (absorbed) of a mixed batch
    mixed = driver.extend([warm, other], [[9], PROMPT[:20]], mixed=True)
    alone = driver.decode([cold], [9])[0]
    torch.testing.assert_close(mixed[0], alone, atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[1], logits[19], atol=ATOL, rtol=0)


def test_decode_runs_the_absorbed_form(model_dir):
    """A decode step never up-projects the context (kv_b_proj runs in prefill only)."""
    driver = _driver(model_dir, "v3", 16)
    calls = []
    for layer in driver.runner.model.model.layers:
        layer.self_attn.kv_b_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    seq = driver.new_seq()
    driver.extend([seq], [PROMPT])
    assert calls == [(len(PROMPT), 32)] * 3
    calls.clear()
    for token in (5, 6, 7):
        driver.decode([seq], [token])
    assert calls == []


def test_pool_log_line_shows_mla_bytes(model_dir, caplog):
    from sglite.model_executor.model_runner import ModelRunner

    with caplog.at_level(logging.INFO, logger="sglite.model_executor.model_runner"):
        runner = ModelRunner(model_dir("v3"), device="cpu", max_total_tokens=256)
    # 3 layers x (32 + 8) fp32 dims; MHA: 3 layers x 4 heads x (24 + 24) dims
    line = next(r.getMessage() for r in caplog.records if "B/token" in r.getMessage())
    assert "KV pool: 256 tokens, 480 B/token (MLA latent 32 + rope 8; MHA would need " in line
    assert "2,304 B/token" in line
    assert runner.kv_pool.memory_bytes() == (256 + 1) * 480


# ---------------------------------------------------------------- config refusals


def _config(arch: str, **fields):
    from fixtures.tiny_models import tiny_config
    from sglite.models.model_config import ModelConfig

    return ModelConfig.from_hf(tiny_config(arch, config=fields))


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_moe_layers_are_refused_by_name(arch):
    from sglite.models.registry import get_model_class

    cfg = _config(arch, first_k_dense_replace=1)
    with pytest.raises(ValueError, match=r"first_k_dense_replace=1 .*layers 1\.\.2 of 3 are "
                       r"mixture-of-experts"):  # fmt: skip
        get_model_class(cfg.architecture)(cfg, dtype=torch.float32)


def test_architectures_registered_by_their_hf_names():
    from sglite.models.registry import supported_architectures

    assert {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"} <= set(supported_architectures())


def test_mtp_layers_of_a_v3_checkpoint_are_not_loaded(model_dir):
    """V3 checkpoints carry `num_nextn_predict_layers` layers after the last one."""
    from sglite.models.loader import iter_weights
    from sglite.models.model_config import ModelConfig
    from sglite.models.registry import get_model_class

    path = model_dir("v3")
    cfg = ModelConfig.from_pretrained(path)
    model = get_model_class(cfg.architecture)(cfg, dtype=torch.float32)
    extra = [("model.layers.3.eh_proj.weight", torch.zeros(4, 4))]
    model.load_weights(list(iter_weights(path)) + extra)
