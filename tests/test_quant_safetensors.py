"""Safetensors checkpoints quantized by their producer (--quantization w8a8_int8, fp8, awq,
gptq) against their dequantized twin written as a float checkpoint (fixtures.quant_checkpoints),
on tiny random Llama and Qwen2 models, CPU:

- awq / gptq (repacked into Q4_0 / Q4_1 blocks, `--quant-kernel exact`): greedy tokens equal,
  logits within INT4_TOL of the largest logit (the f16 rounding of Q4_1's `m`); symmetric
  GPTQ is Q4_0 and exact;
- fp8 (dequantized at load): the twin's logits within float rounding, per-tensor, per-channel
  and block scales;
- w8a8_int8: logits within W8A8_TOL of the largest logit (activations rounded to int8 per
  token), teacher-forced on the twin's tokens;
- one Engine run of an AWQ checkpoint, detected from its config.json: the dequantized twin's
  greedy tokens through the scheduler.
The CUDA wiring (fake kernels) and the repack's rounding are in test_quant_safetensors_layers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fixtures.model_driver import Driver
from fixtures.quant_checkpoints import write_quantized
from sglite.layers import quant_kernels

STEPS = 5
# Q4_1's m = -scale * zero rounded to f16 (<= 2^-11 * 16 * scale a weight), relative to the
# largest logit (measured: 1.6e-3 to 1.8e-3 on these tiny models; symmetric GPTQ, Q4_0: 8e-7)
INT4_TOL = 4e-3
# activations rounded to int8 per token against float32 ones, teacher-forced (measured: 0.025
# Qwen2, 0.028 Llama; tiny random models amplify it, hidden size 64)
W8A8_TOL = 0.06


def runner(path, **kwargs):
    from sglite.model_executor.model_runner import ModelRunner

    kwargs = {"max_total_tokens": 512, "max_running_requests": 4, **kwargs}
    return ModelRunner(str(path), device="cpu", dtype="float32", **kwargs)


def greedy(run, prompts, forced=None):
    """(tokens per prompt, logits [B, STEPS, V]); `forced`: tokens fed back instead."""
    driver = Driver(run)
    seqs = [driver.new_seq() for _ in prompts]
    logits = [driver.extend(seqs, prompts)]
    outs = [[t] for t in logits[0].argmax(-1).tolist()]
    for step in range(STEPS - 1):
        feed = [o[-1] for o in outs] if forced is None else [f[step] for f in forced]
        logits.append(driver.decode(seqs, feed))
        for o, t in zip(outs, logits[-1].argmax(-1).tolist()):
            o.append(t)
    for s in seqs:
        driver.release(s)
    return outs, torch.stack(logits, dim=1)


PROMPTS = [np.random.default_rng(1).integers(3, 300, n).tolist() for n in (5, 11, 19)]


def compare(quant_dir, ref_dir, *, forced: bool = False, **kwargs):
    """(max |logit error| / max |logit|, tokens equal, the quantized model's layer kinds, and
    the segment kinds of its first down_proj)."""
    want, want_logits = greedy(runner(ref_dir), PROMPTS)
    run = runner(quant_dir, **kwargs)
    kinds = {type(m).__name__ for m in run.model.modules()}
    got, got_logits = greedy(run, PROMPTS, forced=want if forced else None)
    err = (got_logits - want_logits).abs().max().item() / want_logits.abs().max().item()
    down = run.model.model.layers[0].mlp.down_proj
    if hasattr(down, "packed"):
        kinds |= {type(seg).__name__ for _, seg in down.packed.segments}
    return err, got == want, kinds


needs_kernels = pytest.mark.skipif(
    quant_kernels.unavailable_reason() is not None, reason="native quant kernels missing"
)


@needs_kernels
@pytest.mark.parametrize(
    ("arch", "method", "opts"),
    [
        ("llama", "awq", dict(group_size=32)),
        ("qwen2", "awq", dict(group_size=-1)),
        ("llama", "gptq", dict(group_size=32)),
        ("llama", "gptq", dict(group_size=64, sym=True)),
        ("qwen2", "gptq", dict(group_size=32, v2=True)),
        ("llama", "awq", dict(group_size=64, keep_float=["down_proj"])),
    ],
    ids=[
        "llama-awq-g32",
        "qwen2-awq-row",
        "llama-gptq-g32",
        "llama-gptq-sym",
        "qwen2-gptq-v2",
        "llama-awq-float-down",
    ],  # fmt: skip
)
def test_int4_checkpoints_give_the_dequantized_models_tokens(
    tiny_model_dir, tmp_path, arch, method, opts
):
    quant_dir, ref_dir = write_quantized(tiny_model_dir(arch), tmp_path, method, **opts)
    err, same, kinds = compare(quant_dir, ref_dir, quant_kernel="exact")
    assert "QuantQKVParallelLinear" in kinds and "ParallelLMHead" in kinds
    assert ("DenseRows" in kinds) == bool(opts.get("keep_float"))  # modules_to_not_convert
    assert same
    assert err <= (1e-5 if opts.get("sym") else INT4_TOL), err
    # the default kernel (int16 activations): the same tokens, within its rounding
    err16, same, kinds = compare(quant_dir, ref_dir)
    assert same and err16 <= err + 1e-3, (err16, err)
    assert "PanelRows" in kinds or "DenseRows" in kinds


@pytest.mark.parametrize(
    "opts",
    [dict(scale="tensor"), dict(scale="channel"), dict(scale="block", block=(32, 32))],
    ids=["tensor", "channel", "block"],
)
def test_fp8_checkpoints_are_dequantized_at_load(tiny_model_dir, tmp_path, opts):
    quant_dir, ref_dir = write_quantized(tiny_model_dir("llama"), tmp_path, "fp8", **opts)
    err, same, kinds = compare(quant_dir, ref_dir)
    assert same and err <= 1e-5, err
    assert "QKVParallelLinear" in kinds  # float layers: nothing packed on CPU


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_w8a8_int8_rounds_activations_per_token(tiny_model_dir, tmp_path, arch):
    quant_dir, ref_dir = write_quantized(tiny_model_dir(arch), tmp_path, "w8a8_int8")
    err, _, kinds = compare(quant_dir, ref_dir, forced=True)
    assert "QuantRowParallelLinear" in kinds
    assert 0 < err <= W8A8_TOL, err


@needs_kernels
def test_engine_serves_an_awq_checkpoint_detected_from_its_config(tiny_model_dir, tmp_path):
    import sglite

    quant_dir, ref_dir = write_quantized(tiny_model_dir("llama"), tmp_path, "awq")
    want, _ = greedy(runner(ref_dir), PROMPTS[:2])
    params = {"max_new_tokens": STEPS, "temperature": 0, "ignore_eos": True}
    with sglite.Engine(model_path=str(quant_dir), max_total_tokens=512, log_level="warning") as e:
        outs = e.generate(input_ids=PROMPTS[:2], sampling_params=params)
    assert [o["output_ids"] for o in outs] == want
