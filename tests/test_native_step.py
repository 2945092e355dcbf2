"""The native decode step (sglite.model_executor.native_step, rust/step) against the per-op
path it replaces, on tiny random GGUF checkpoints of each dense family it takes: the logits
of every decode step within 1e-5 of the largest logit and the same greedy tokens, through
sliding windows shorter than the prompt (Gemma 3), two rotary tables, (1 + w) norms, the
sandwich layout and GeGLU, q/k norms (Qwen3, Gemma 3), biases (Qwen2), longrope (Phi-3), a
Q4_K_M-like mix; page sizes 1 and 16, both tree cores, and rows sharing a cached prefix.
The rule that sends a model to the per-op path is tested by name.
"""

from __future__ import annotations

import logging

import pytest
import torch

from fixtures.backends import BACKENDS, load_backend
from fixtures.gguf_models import build_hf_model
from fixtures.gguf_writer import write_gguf
from fixtures.model_driver import Driver
from sglite.layers import quant_kernels

pytestmark = pytest.mark.skipif(
    quant_kernels.unavailable_reason() is not None, reason="native quant kernels missing"
)

K_DIMS = dict(hidden_size=256, intermediate_size=512, head_dim=64)
Q4_K_M = {
    "output.weight": "Q6_K",
    **{f"blk.{i}.attn_v.weight": "Q6_K" for i in range(3)},
    **{f"blk.{i}.ffn_down.weight": "Q6_K" for i in (0, 2)},
}
CASES = [
    ("llama", "Q8_0", False, None),
    ("llama_bias_tied", "Q4_0", False, None),
    ("qwen2", "Q4_1", False, None),
    ("gemma3", "Q5_0", False, None),
    ("phi3", "Q5_1", False, None),
    ("llama", "Q4_K", True, Q4_K_M),
    ("qwen3", "Q5_K", True, None),
]
STEPS = 8


@pytest.fixture(scope="module")
def gguf_case(tmp_path_factory):
    made = {}

    def make(variant, qtype, kdims=False, types=None):
        key = (variant, qtype, kdims, repr(types))
        if key not in made:
            root = tmp_path_factory.mktemp(variant)
            hf = build_hf_model(variant, root / "hf", **(K_DIMS if kdims else {}))
            made[key] = write_gguf(hf, root / f"{qtype}.gguf", qtype=qtype, types=types)
        return made[key]

    return make


def runner(path, **kwargs):
    from sglite.model_executor.model_runner import ModelRunner

    kwargs = {"max_total_tokens": 2048, "max_running_requests": 8, **kwargs}
    return ModelRunner(str(path), device="cpu", **kwargs)


def decode_logits(run, prompts, shared: int = 0) -> torch.Tensor:
    """Logits `[B, STEPS, V]`: the prompts' prefill, then STEPS - 1 greedy decode steps; with
    `shared`, every row after the first reuses the first row's first `shared` slots."""
    driver = Driver(run)
    if shared:
        first = driver.new_seq()
        logits = [driver.extend([first], [prompts[0]])]
        seqs = [first] + [driver.new_seq(first, shared) for _ in prompts[1:]]
        logits = [
            torch.cat([logits[0], driver.extend(seqs[1:], [p[shared:] for p in prompts[1:]])])
        ]
    else:
        seqs = [driver.new_seq() for _ in prompts]
        logits = [driver.extend(seqs, prompts)]
    for _ in range(STEPS - 1):
        logits.append(driver.decode(seqs, logits[-1].argmax(-1).tolist()))
    for s in reversed(seqs):
        driver.release(s)
    return torch.stack(logits, dim=1)


def both_paths(run, prompts, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    assert run.native_step is not None
    native = decode_logits(run, prompts, shared)
    step, run.native_step = run.native_step, None
    try:
        per_op = decode_logits(run, prompts, shared)
    finally:
        run.native_step = step
    return native, per_op


def assert_same(native, per_op, what):
    scale = per_op.abs().max().item()
    err = (native - per_op).abs().max().item()
    assert err <= 1e-5 * scale, (what, err / scale)
    assert torch.equal(native.argmax(-1), per_op.argmax(-1)), what


def prompts(vocab: int, lens=(5, 11, 23)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]


@pytest.mark.parametrize(
    ("variant", "qtype", "kdims", "types"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_native_step_equals_the_per_op_path(gguf_case, variant, qtype, kdims, types):
    run = runner(gguf_case(variant, qtype, kdims, types))
    native, per_op = both_paths(run, prompts(run.model_config.vocab_size))
    assert_same(native, per_op, variant)


@pytest.mark.parametrize("core_name", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_page_sizes_tree_cores_and_a_shared_prefix(gguf_case, core_name, page_size):
    load_backend(core_name)
    run = runner(gguf_case("gemma3", "Q8_0"), page_size=page_size, tree_core=core_name)
    ps = prompts(run.model_config.vocab_size, (40, 40, 40, 40))
    ps = [ps[0]] + [ps[0][:32] + p[32:] for p in ps[1:]]  # a 32-token common prefix
    native, per_op = both_paths(run, ps, shared=32)
    assert_same(native, per_op, (core_name, page_size))


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8_e4m3"])
def test_narrow_kv_pools(gguf_case, kv_cache_dtype):
    run = runner(gguf_case("qwen2", "Q4_1"), kv_cache_dtype=kv_cache_dtype)
    native, per_op = both_paths(run, prompts(run.model_config.vocab_size))
    assert_same(native, per_op, kv_cache_dtype)


def test_the_rule_names_why_a_model_takes_the_per_op_path(gguf_case, caplog):
    from sglite.model_executor import native_step

    cases = [
        (("starcoder2", "Q8_0"), {}, "a non-gated MLP"),
        (("llama", "Q8_0"), {"quant_kernel": "exact"}, "qkv_proj is not held in panels"),
        (("llama", "Q8_0"), {"quantization": "none"}, "qkv_proj is not held in panels"),
        (("llama", "Q8_0"), {"attention_backend": "torch_native"}, "attention backend"),
        (("llama", "Q8_0"), {"dtype": "bfloat16"}, "activations in torch.bfloat16"),
    ]
    for (variant, qtype), kwargs, reason in cases:
        with caplog.at_level(logging.INFO, logger=native_step.__name__):
            caplog.clear()
            run = runner(gguf_case(variant, qtype), **kwargs)
        assert run.native_step is None
        assert reason in native_step.unsupported_reason(run), (variant, kwargs)
        assert any(
            reason in r.getMessage() and "per-op path" in r.getMessage() for r in caplog.records
        )
    with caplog.at_level(logging.INFO, logger=native_step.__name__):
        caplog.clear()
        run = runner(gguf_case("llama", "Q8_0"))
    assert run.native_step is not None
    assert any("decode step: native" in r.getMessage() for r in caplog.records)
