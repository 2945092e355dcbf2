"""Every MoE family on a tiny random checkpoint matches transformers on the same weights.

Qwen2-MoE, Qwen3-MoE, Mixtral (and Mixtral with a sliding window shorter than the prompt),
OLMoE from tests/fixtures/tiny_moe.py: 8 experts, top-2, dense layers where the family has
them, random routers (each sparse layer sends the prompt's 40 tokens to at least 4
different expert pairs, the first layers to 10 or more: checked). At page sizes 1 and 16 over a fragmented allocator: the logits of a one-shot
prefill and of a chunked one match transformers' forward (1e-4), so does a prefill over a
warm prefix, and greedy decoding gives transformers.generate's tokens and logits. The same
weights saved in transformers' fused in-memory layout (`experts.gate_up_proj [E, 2I, H]`)
load to the same logits; a missing expert tensor is named in the checkpoint's own terms.
The engine, scheduler loops, tree cores and tensor parallelism: tests/test_moe_engine.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from fixtures.model_driver import Driver, fragment_allocator

CASES = {
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "mixtral": ("mixtral", {}),
    "mixtral_window": ("mixtral", {"config": {"sliding_window": 16}}),
    "olmoe": ("olmoe", {}),
}
PAGE_SIZES = (1, 16)
ATOL = 1e-4
CHUNKS = (13, 29)
DECODE_STEPS = 12
PROMPT = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(name: str):
        if name not in cache:
            arch, opts = CASES[name]
            path = tiny_model_dir(arch, **opts)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None  # decode the full length
            cache[name] = model
        return cache[name]

    return get


@torch.no_grad()
def _hf_generate(hf, ids: list[int], steps: int):
    out = hf.generate(
        torch.tensor([ids]),
        max_new_tokens=steps,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences[0, len(ids) :].tolist(), [s[0].float() for s in out.logits]


@pytest.fixture(scope="module")
def hf_ref(hf_model):
    """(prompt logits, generate's tokens, generate's logits) per case."""
    cache = {}

    def get(name: str):
        if name not in cache:
            hf = hf_model(name)
            with torch.no_grad():
                logits = hf(torch.tensor([PROMPT])).logits[0].float()
            cache[name] = (logits, *_hf_generate(hf, PROMPT, DECODE_STEPS))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    from sglite.model_executor.model_runner import ModelRunner

    cache = {}

    def get(name: str, page_size: int):
        if (name, page_size) not in cache:
            arch, opts = CASES[name]
            r = ModelRunner(
                tiny_model_dir(arch, **opts),
                device="cpu",
                page_size=page_size,
                max_total_tokens=1024,
                max_running_requests=8,
            )
            fragment_allocator(r.allocator, seed=page_size)
            cache[name, page_size] = r
        return cache[name, page_size]

    return get


@pytest.mark.parametrize("name", sorted(CASES))
def test_routing_sends_tokens_to_many_experts(name, hf_model):
    """The test's premise: every sparse layer routes the prompt's tokens differently."""
    hf, chosen = hf_model(name), []
    gates = [m for n, m in hf.named_modules() if n.endswith("mlp.gate")]
    hooks = [g.register_forward_hook(lambda m, i, out: chosen.append(out[2])) for g in gates]
    try:
        with torch.no_grad():
            hf(torch.tensor([PROMPT]))
    finally:
        for h in hooks:
            h.remove()
    dense = sum(1 for layer in hf.model.layers if not hasattr(layer.mlp, "gate"))
    assert len(chosen) == len(hf.model.layers) - dense >= 2
    pairs = [len({tuple(sorted(row)) for row in ids.tolist()}) for ids in chosen]
    assert min(pairs) >= 4 and max(pairs) >= 10, f"expert pairs per sparse layer: {pairs}"
    assert min(len(ids.unique()) for ids in chosen) >= 4


def test_the_families_have_the_parts_under_test(runner):
    from sglite.layers.moe import SparseMoeBlock

    def kinds(name):
        layers = runner(name, 1).model.model.layers
        return [isinstance(layer.mlp, SparseMoeBlock) for layer in layers]

    assert kinds("qwen2_moe") == [True, True, False, True]  # mlp_only_layers=[2]
    assert kinds("qwen3_moe") == [False, True, False, True]  # decoder_sparse_step=2
    assert all(kinds("mixtral")) and all(kinds("olmoe"))
    qwen2 = runner("qwen2_moe", 1).model.model.layers[0].mlp
    assert qwen2.shared_expert is not None and qwen2.shared_expert_gate is not None
    assert runner("qwen3_moe", 1).model.model.layers[1].mlp.gate.spec.renormalize
    assert not runner("olmoe", 1).model.model.layers[0].mlp.gate.spec.renormalize
    assert runner("mixtral_window", 1).model_config.layer_sliding_windows == (16,) * 3
    assert runner("mixtral", 1).model.model.layers[0].mlp.experts._packed is not None


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_one_shot_and_chunked_match_transformers(name, page_size, runner, hf_ref):
    driver, ref = Driver(runner(name, page_size)), hf_ref(name)[0]
    assert ref.std() > 0.1, "degenerate model: the test would not catch much"
    seq = driver.new_seq()
    logits = driver.extend([seq], [PROMPT], return_all_logits=True)
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    driver.release(seq)
    seq, start, chunks = driver.new_seq(), 0, []
    for end in (*CHUNKS, len(PROMPT)):
        chunks.append(driver.extend([seq], [PROMPT[start:end]], return_all_logits=True))
        start = end
    torch.testing.assert_close(torch.cat(chunks), ref, atol=ATOL, rtol=0)
    driver.release(seq)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_over_a_warm_prefix_matches_transformers(name, page_size, runner, hf_ref):
    driver, ref = Driver(runner(name, page_size)), hf_ref(name)[0]
    cold = driver.new_seq()
    driver.extend([cold], [PROMPT])
    half = 16 if page_size == 16 else 19
    warm = driver.new_seq(prefix=cold, prefix_len=half)
    logits = driver.extend([warm], [PROMPT[half:]], return_all_logits=True)
    assert warm.slots[:half] == cold.slots[:half]
    torch.testing.assert_close(logits, ref[half:], atol=ATOL, rtol=0)
    driver.release(warm)
    driver.release(cold)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_decode_matches_transformers_generate(name, page_size, runner, hf_ref):
    _, expected, ref_logits = hf_ref(name)
    driver = Driver(runner(name, page_size))
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


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_fused_expert_checkpoint_loads_the_same(name, tiny_model_dir, hf_model, hf_ref, tmp_path):
    """transformers 5 holds experts fused in memory; a checkpoint saved in that layout (no
    per-expert conversion) loads into the same model."""
    from safetensors.torch import save_file

    from sglite.model_executor.model_runner import ModelRunner

    arch, opts = CASES[name]
    folder = tmp_path / name
    shutil.copytree(tiny_model_dir(arch, **opts), folder)
    state = {k: v.contiguous() for k, v in hf_model(name).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    assert not any(".experts.0." in k for k in state)
    (folder / "model.safetensors").unlink()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    driver = Driver(ModelRunner(folder, device="cpu", max_total_tokens=256))
    logits = driver.extend([driver.new_seq()], [PROMPT], return_all_logits=True)
    torch.testing.assert_close(logits, hf_ref(name)[0], atol=ATOL, rtol=0)


def test_a_missing_expert_tensor_is_named_as_the_checkpoint_names_it(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from sglite.model_executor.model_runner import ModelRunner

    folder = tmp_path / "mixtral"
    shutil.copytree(tiny_model_dir("mixtral"), folder)
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"lacks 1 tensor.*layers\.1\.block_sparse_moe\.experts\.3\.w3"
    ):
        ModelRunner(folder, device="cpu", max_total_tokens=256)
